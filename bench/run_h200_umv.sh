#!/usr/bin/env bash
# The H200 run for B3 (issue 4): llama3-8b, a 128K-token context within a 24 GB budget, every
# tier case beside the pure-GPU, unbudgeted and HF baselines. Extra arguments go to the
# benchmark, e.g. --cases b3a,b3b_gpu,hf to fit one device call. Invoked through the device tool from
# the repo root with `.whl` carried; HYBRIDGEN_COMMIT names the commit being measured.
source scripts/device_setup.sh
set -o pipefail
# The in-place Warm kernels on the registered pool first (test_warm_device.py runs them on CUDA).
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_warm_device.py tests/test_gpu.py \
  -k "warm or place" 2>&1 | tee "$OUT/pytest_umv.log" | tail -n 3
# A 1,024-token prefill chunk: at 2,048 the step workspace leaves int4 Hot short of one 128K
# sequence (B3a fails with BudgetTooSmall, and B3c's sequences could not take turns in Hot).
python3 -m hybridgen.benchmarks.umv_bench --model llama3-8b --context-len 131072 \
  --new-tokens 64 --budget-mb 24576 --chunk 1024 --turn-tokens 16 --out "$OUT/umv.json" "$@" \
  2>"$OUT/umv_stderr.log" | tee "$OUT/umv_table.txt"
tail -n 5 "$OUT/umv_stderr.log"
