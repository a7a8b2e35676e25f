#!/usr/bin/env bash
# The H200 run for the engine (issue 2): GPU tests, then the B1 benchmark and batch sweep
# with HF transformers on the same weights. Invoked through the device tool from the repo root
# with `.whl` carried; HYBRIDGEN_COMMIT names the commit being measured.
source scripts/device_setup.sh
set -o pipefail
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu.txt"
timeout 240 python3 -m pytest -q -x -p no:cacheprovider tests/test_gpu.py \
  tests/test_kernels.py::test_gemv tests/test_kernels.py::test_linear_matches_reference \
  tests/test_sampling.py \
  2>&1 | tee "$OUT/pytest_gpu.log" | tail -n 25
python3 -m hybridgen.benchmarks.engine_bench --hf --gpu-memory-mb 40960 "$@" \
  --out "$OUT/engine.json" 2>"$OUT/bench_stderr.log" | tee "$OUT/bench_table.txt"
tail -n 5 "$OUT/bench_stderr.log"
