#!/usr/bin/env bash
# Issue 17's H200 run: the dense int8/int4 kernel tests on CUDA and their microbenchmark
# (bench/dense_quant_bench.py: each projection at T = 1 and 512, and at T = 1 the int4 word
# GEMV, the tensor-core GEMV's variants and torch's tinygemm side by side), then B1 with int4 weights
# (llama3-8b synthetic, batch 1, prompt 512, 256 new tokens) in-process (engine_bench) and
# served (the load client, its --inprocess run beside it). Target: >= 450 tok/s (the int4
# weights are ~4.5 GB a token: the roofline is ~900). Invoked through the device tool from the
# repo root with `.whl` carried; results land in $OUT as JSON.
source scripts/device_setup.sh
set -o pipefail
timeout 300 python3 -m pytest -q -p no:cacheprovider tests/test_dense_quant.py \
  -k "kernel or word or mma or dp4a or choose or swiglu or rope or repacked" \
  2>&1 | tee "$OUT/dense_quant_tests.log" | tail -n 5
# The decode kernel's CUDA cases (the split merge among them), and the compile keys.
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_kernels_attention.py \
  tests/test_kernel_compiles.py 2>&1 | tee "$OUT/attention_tests.log" | tail -n 3
python3 bench/dense_quant_bench.py --kernel new,mma,dp4a,dp4a16,dp4a_w4,dp4a_k1,tinygemm 2>"$OUT/dense_quant_stderr.log" | tee "$OUT/dense_quant_table.txt"
python3 -m hybridgen.benchmarks.engine_bench --model llama3-8b --weights-format int4 \
  --batches 1 --prompt-len 512 --new-tokens 256 --gpu-memory-mb 40960 \
  --out "$OUT/engine_int4.json" 2>"$OUT/bench_stderr.log" | tee "$OUT/bench_table.txt"
python3 -m hybridgen.benchmarks.load --serve-dir /tmp/serve --config bench/served/b1_int4.yaml \
  --requests 1 --prompt-len 512 --max-new-tokens 256 --inprocess --name b1_int4 \
  --out "$OUT/b1_int4.json" 2>>"$OUT/bench_stderr.log"
tail -n 5 "$OUT/bench_stderr.log"
