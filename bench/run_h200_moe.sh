#!/usr/bin/env bash
# The H200 runs for B4 (issue 6), one device call each:
#   bash bench/run_h200_moe.sh sweep  the expert kernels' tile sweep (bench/quant_gemv_bench.py)
#                                     and one expert on the host's CPU (bench/cpu_expert_bench.py)
#   bash bench/run_h200_moe.sh 8x7b   the MoE and quantized-expert GPU tests, then mixtral-8x7b
#   bash bench/run_h200_moe.sh grouped  the grouped expert kernels' tests on CUDA, then one layer's
#                                     cache hits, grouped vs per expert (grouped_experts_bench.py)
#   bash bench/run_h200_moe.sh 8x22b  mixtral-8x22b, one case per invocation, so that a case
#                                     cut short by the device's time limit leaves the others
# Each: int4 experts in host memory and a device cache sized from a 24 GB budget, uniform and
# skewed routing, beside accelerate's offloading (8x22b's cut to 8 of 56 layers: its bf16
# weights would not fit the host). Invoked through the device tool from the repo root with
# `.whl` carried; HYBRIDGEN_COMMIT names the commit being measured.
source scripts/device_setup.sh
set -o pipefail
bench() { python3 -m hybridgen.benchmarks.moe_bench --budget-mb 24576 --expert-format int4 "$@" \
  2>>"$OUT/moe_stderr.log" | tee -a "$OUT/moe_table.txt"; }
case "${1:-8x7b}" in
  sweep)
    timeout 240 python3 bench/quant_gemv_bench.py 2>&1 | tee "$OUT/quant_gemv.txt" | tail -n 6
    timeout 60 python3 bench/cpu_expert_bench.py 2>&1 | tee "$OUT/cpu_expert.txt"
    ;;
  8x7b)
    timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_kernels.py tests/test_gpu.py \
      -k "quant_gemv or int4_gemv or quantized or cold or graph" 2>&1 \
      | tee "$OUT/pytest_moe.log" | tail -n 3
    bench --model mixtral-8x7b --out "$OUT/moe_8x7b.json"
    ;;
  grouped)
    timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_grouped_experts.py \
      tests/test_grouped_moe_block.py 2>&1 | tee "$OUT/pytest_grouped.log" | tail -n 3
    timeout 300 python3 bench/grouped_experts_bench.py 2>&1 | tee "$OUT/grouped_experts.txt"
    ;;
  8x22b)
    for case in uniform skewed accelerate; do
      bench --model mixtral-8x22b --new-tokens 32 --baseline-layers 8 --cases "$case" \
        --out "$OUT/moe_8x22b_$case.json"
    done
    ;;
  *) echo "usage: $0 sweep|grouped|8x7b|8x22b" >&2; exit 2 ;;
esac
tail -n 5 "$OUT/moe_stderr.log"
