#!/usr/bin/env bash
# The H200 run for the serving overhead (issue 3, BENCHMARKS.md B5): tiny-llama in-process vs
# through `hybridgen serve` on the GPU, ring throughput and latency, heartbeat jitter, and the
# decode cost of each sampling placement (placements.sample gpu vs cpu).
# Invoked through the device tool from the repo root with `.whl` carried; HYBRIDGEN_COMMIT
# names the commit being measured.
source scripts/device_setup.sh
set -o pipefail
python3 -m hybridgen.benchmarks.serving_overhead --device cuda "$@" \
  --out "$OUT/serving_overhead.json" 2>"$OUT/serving_stderr.log" | tee "$OUT/serving_table.txt"
tail -n 5 "$OUT/serving_stderr.log"
python3 -m hybridgen.benchmarks.sample_placement --device cuda \
  --out "$OUT/sample_placement.json" 2>>"$OUT/serving_stderr.log" | tee -a "$OUT/serving_table.txt"
