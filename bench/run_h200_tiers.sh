#!/usr/bin/env bash
# The H200 run for the KV tiers (issue 4) so far: the compressed Hot-KV kernels compiled on the
# GPU (their tests), prefix reuse on llama3-8b (turn-2 TTFT with and without the cache), and
# batch-1 decode at a 32K context with each hot_codec. Invoked through the device tool from
# the repo root with `.whl` carried; HYBRIDGEN_COMMIT names the commit being measured.
source scripts/device_setup.sh
set -o pipefail
timeout 200 python3 -m pytest -q -x -p no:cacheprovider tests/test_hot_codec_kernels.py \
  tests/test_hot_codec_engine.py 2>&1 | tee "$OUT/pytest_tiers.log" | tail -n 5
python3 -m hybridgen.benchmarks.prefix_reuse --model llama3-8b --prefix-len 8192 \
  --gpu-memory-mb 40960 --out "$OUT/prefix_reuse.json" 2>"$OUT/prefix_stderr.log" \
  | tee "$OUT/tiers_table.txt"
for codec in native int8 int4; do
  python3 -m hybridgen.benchmarks.engine_bench --batches 1 --prompt-len 32768 \
    --new-tokens 128 --runs 1 --max-model-len 33024 --gpu-memory-mb 40960 \
    --hot-codec "$codec" --out "$OUT/hot_codec_$codec.json" 2>>"$OUT/bench_stderr.log" \
    | tail -n 3 | tee -a "$OUT/tiers_table.txt"
done
