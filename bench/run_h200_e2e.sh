#!/usr/bin/env bash
# The H200 run for B6 (issue 5): the GPU tests first, then the article's end-to-end benchmark
# through the gateway, hybrid against pure-GPU within a 24 GB budget (bench/b6.yaml): the
# long mixed prompts at batch 4, then the many-short-requests case at batch 16.
# `--no-tests` skips the GPU tests.
# Invoked through the device tool from the repo root with `.whl` carried; HYBRIDGEN_COMMIT
# names the commit being measured.
source scripts/device_setup.sh
set -o pipefail
nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$OUT/gpu.txt"
if [ "${1:-}" != "--no-tests" ]; then  # the GPU tests take about 100 s
  timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py \
    tests/test_warm_device.py tests/test_hot_codec_kernels.py tests/test_kernels_attention.py \
    2>&1 | tee "$OUT/pytest_gpu.log" | tail -n 8
fi
work=/tmp/e2e
for case in "b6 bench/prompts_b6.jsonl 4 128" "short bench/prompts_short.jsonl 16 64"; do
  set -- $case
  python3 -m hybridgen.benchmarks.e2e_benchmark --config bench/b6.yaml --prompt-file "$2" \
    --batch-size "$3" --max-new-tokens "$4" --compare --out "$work/$1" 2>"$work-$1.log" \
    | tee "$OUT/$1_table.txt"
  tail -n 3 "$work-$1.log"
  cp "$work/$1/e2e.json" "$OUT/e2e_$1.json"
  cp "$work/$1/e2e_latency.png" "$OUT/e2e_$1.png"
done
tar czf "$OUT/e2e_logs.tgz" -C /tmp e2e e2e-b6.log e2e-short.log 2>/dev/null
