#!/usr/bin/env bash
# The H200 run for B4 (issue 6): the quantized-expert GPU tests, then mixtral-8x7b and
# mixtral-8x22b with int4 experts in host memory and a device cache sized from a 24 GB budget,
# under uniform and skewed routing, beside accelerate's offloading (8x22b's cut to 8 of 56
# layers: its bf16 weights would not fit the host). 8x22b runs one case per invocation, so
# that a case cut short by the device's time limit leaves the others' results.
# Invoked through the device tool from the repo root with `.whl` carried; HYBRIDGEN_COMMIT
# names the commit being measured.
source scripts/device_setup.sh
set -o pipefail
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_kernels.py tests/test_gpu.py \
  -k "quant_gemv or quantized or cold" 2>&1 | tee "$OUT/pytest_moe.log" | tail -n 3
bench() { python3 -m hybridgen.benchmarks.moe_bench --budget-mb 24576 --expert-format int4 "$@" \
  2>>"$OUT/moe_stderr.log" | tee -a "$OUT/moe_table.txt"; }
bench --model mixtral-8x7b --out "$OUT/moe_8x7b.json"
for case in uniform skewed accelerate; do
  bench --model mixtral-8x22b --new-tokens 32 --baseline-layers 8 --cases "$case" \
    --out "$OUT/moe_8x22b_$case.json"
done
tail -n 5 "$OUT/moe_stderr.log"
