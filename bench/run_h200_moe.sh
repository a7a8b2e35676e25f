#!/usr/bin/env bash
# The H200 run for B4 (issue 6): the MoE GPU tests, then mixtral-8x7b and mixtral-8x22b with
# int4 experts in host memory and a device cache sized from a 24 GB budget, under uniform and
# skewed routing, beside accelerate's offloading (8x22b's cut to 16 layers: its bf16 weights
# would not fit the host). Invoked through the device tool from the repo root with `.whl`
# carried; HYBRIDGEN_COMMIT names the commit being measured.
source scripts/device_setup.sh
set -o pipefail
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py -k "experts or cold" \
  2>&1 | tee "$OUT/pytest_moe.log" | tail -n 3
python3 -m hybridgen.benchmarks.moe_bench --model mixtral-8x7b --budget-mb 24576 \
  --expert-format int4 --out "$OUT/moe_8x7b.json" 2>"$OUT/moe_stderr.log" | tee "$OUT/moe_table.txt"
python3 -m hybridgen.benchmarks.moe_bench --model mixtral-8x22b --budget-mb 24576 \
  --expert-format int4 --baseline-layers 16 --out "$OUT/moe_8x22b.json" \
  2>>"$OUT/moe_stderr.log" | tee -a "$OUT/moe_table.txt"
tail -n 5 "$OUT/moe_stderr.log"
