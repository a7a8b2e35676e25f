#!/usr/bin/env bash
# Issue 16's H200 runs through `hybridgen serve` and the project's load client, one device call
# per argument group (each well inside 10 minutes):
#   tests  every CUDA test in one pytest process (scripts/cuda_suite.py, kernels compiled
#          first by 12 processes; in the background, `tests_wait` in the next call collects
#          what outlasts this one)
#   b12    B1 (one stream, in-process beside it) and B2 (64 streams at once, then Poisson at
#          80 % of the measured capacity), llama3-8b
#   b3a    one 131,072-token prompt, int4 Hot, 24 GB budget
#   b4a    mixtral-8x7b, int4 experts, 24 GB budget: 1 stream (in-process beside it), 4 streams
#   b4c    qwen3-30b-a3b, int4 experts, 12 GB budget: 1 stream (in-process beside it), 4 streams
#   b4a_q4, b4c_q4  B4a and B4c with the dense weights at int4 too (bench/served/*_q4.yaml: the
#          attention and LM head at 4 bits, the memory freed going to the expert cache), 1 and
#          4 streams: a row beside B4a / B4c, as llama.cpp users run these models
#   b4c_ab B4c at one stream served twice in one call, as configured and with no expert on the
#          CPU daemon (b4c_gpu_experts.yaml): whether the CPU daemon's experts cost the served
#          step (1.86x the in-process one at 8cb5b74)
#   b4c_profile  B4c in-process at batch 1, 2 and 4: ms a step, misses, and the host time
#          of each part of the MoE layers' expert step (bench/moe_batch_profile.py)
#   moe_kernels  the int4 expert kernels' CUDA tests (test_kernels.py -k "int4 or quant"), the
#          prefill dequantization against torch's ops (expert_dequant_bench.py) and a CPU expert
#          beside a spinning process and beside H2D copies (cpu_contention.py)
#   b4c_hf HF's Qwen3-MoE of the same shape under accelerate in the same budget (moe_bench's
#          accelerate case), for B4c's comparison
#   b7     llama3-70b, int4 weights, 24 GB budget, layers past gpu_layers auto in host memory
#          (issue 23): 1 request, a 1,024-token prompt, 64 new tokens (in-process beside it)
#   b7_hf  HF's Llama of llama3-70b's shape under accelerate in the same budget, bf16, for B7's
#          comparison (dense_offload_bench): cut to 56 of 80 layers (12 on the device, 77 GB
#          in host memory; all 80 would need 118 GB there), the full depth derived from its
#          layer times; 4 new tokens, as each step copies the same bytes (estimated ~2 min)
#   speech issue 22's speech benchmark: 16 spoken transcripts (1K + 4K tokens, 200 ms chunks
#          over 20 s) through StreamGenerate against the same prompts sent whole, llama3-8b
# Invoked through the device tool from the repo root with `.whl` carried; HYBRIDGEN_COMMIT
# names the commit being measured. Results land in $OUT as JSON; a table is printed last.
source scripts/device_setup.sh
set -o pipefail
load() {  # and the server's start-up (each process's "ready after", the engine's by stage:
  # engine_ready's startup_s) beside its stderr
  rm -rf /tmp/serve
  python3 -m hybridgen.benchmarks.load --serve-dir /tmp/serve "$@" 2>>"$OUT/load_stderr.log"
  grep -h "ready after\|engine_ready" /tmp/serve/serve-*/serve.log /tmp/serve/serve-*/gpu.log \
    >>"$OUT/startup.txt" 2>/dev/null || true
}
rate() { python3 -c "import json,sys; d=json.load(open(sys.argv[1]));
print(round(0.8 * d['median']['total_tok_s'] / d['workload']['max_new_tokens'], 2))" "$1"; }
wait_tests() {  # up to $1 s for the background suite, then its log (and exit code) into $OUT
  for _ in $(seq "$1"); do [ -f /tmp/gpu_tests.rc ] && break; sleep 1; done
  cp /tmp/gpu_tests.log "$OUT/gpu_tests.log" 2>/dev/null; cat /tmp/gpu_suite.out 2>/dev/null
  if [ -f /tmp/gpu_tests.rc ]; then echo "suite exit code $(cat /tmp/gpu_tests.rc)"; tail -n 60 /tmp/gpu_tests.log
  else echo "suite still running: call again with tests_wait"; tail -c 600 /tmp/gpu_tests.log; fi
}
for what in "$@"; do
  case "$what" in
    tests)
      # scripts/cuda_suite.py: every test file that runs on CUDA, in one pytest process, after
      # 12 processes have compiled the kernel tests' Triton kernels side by side (the one
      # process then finds them in the cache). It runs in a session of its own (setsid: the
      # device tool leaves it running) and this call waits 560 s for it; if it is still
      # running, `tests_wait`, the next call (within the machine's 30 s warm window), waits for
      # the rest. Both copy the log so far into $OUT.
      rm -f /tmp/gpu_tests.log /tmp/gpu_tests.rc /tmp/gpu_suite.out
      setsid bash -c 'python3 scripts/cuda_suite.py --log /tmp/gpu_tests.log >/tmp/gpu_suite.out 2>&1;
        echo $? >/tmp/gpu_tests.rc' </dev/null &
      wait_tests 560
      ;;
    tests_wait)
      wait_tests 570
      ;;
    b12)
      load --config bench/served/b1_b2.yaml --requests 1 --prompt-len 512 --max-new-tokens 256 \
        --inprocess --name b1 --out "$OUT/b1.json"
      load --config bench/served/b1_b2.yaml --requests 64 --prompt-len 512 --max-new-tokens 256 \
        --name b2_all --out "$OUT/b2_all.json"
      load --config bench/served/b1_b2.yaml --requests 128 --concurrency 64 --prompt-len 512 \
        --max-new-tokens 256 --arrival poisson --rate "$(rate "$OUT/b2_all.json")" \
        --name b2_poisson --out "$OUT/b2_poisson.json"
      ;;
    speech)
      python3 -m hybridgen.benchmarks.speech_bench --config bench/served/speech.yaml \
        --device cuda --sessions 16 --out "$OUT" 2>>"$OUT/speech_stderr.log"
      ;;
    b3a)
      load --config bench/served/b3a.yaml --requests 1 --prompt-len 131072 --max-new-tokens 64 \
        --warmup 0 --runs 2 --timeout 600 --name b3a --out "$OUT/b3a.json"
      ;;
    b4a)
      load --config bench/served/b4a.yaml --requests 1 --prompt-len 256 --max-new-tokens 64 \
        --inprocess --name b4a_1 --out "$OUT/b4a_1.json"
      load --config bench/served/b4a.yaml --requests 4 --prompt-len 256 --max-new-tokens 64 \
        --name b4a_4 --out "$OUT/b4a_4.json"
      ;;
    b4c)
      load --config bench/served/b4c.yaml --requests 1 --prompt-len 256 --max-new-tokens 64 \
        --inprocess --name b4c_1 --out "$OUT/b4c_1.json"
      load --config bench/served/b4c.yaml --requests 4 --prompt-len 256 --max-new-tokens 64 \
        --name b4c_4 --out "$OUT/b4c_4.json"
      ;;
    b4a_q4|b4c_q4)
      load --config "bench/served/$what.yaml" --requests 1 --prompt-len 256 --max-new-tokens 64 \
        --name "${what}_1" --out "$OUT/${what}_1.json"
      load --config "bench/served/$what.yaml" --requests 4 --prompt-len 256 --max-new-tokens 64 \
        --name "${what}_4" --out "$OUT/${what}_4.json"
      ;;
    b4c_ab)
      load --config bench/served/b4c.yaml --requests 1 --prompt-len 256 --max-new-tokens 64 \
        --name b4c_1 --out "$OUT/b4c_1.json"
      load --config bench/served/b4c_gpu_experts.yaml --requests 1 --prompt-len 256 \
        --max-new-tokens 64 --inprocess --name b4c_1_gpu_experts --out "$OUT/b4c_1_gpu_experts.json"
      ;;
    b7)
      load --config bench/served/b7.yaml --requests 1 --prompt-len 1024 --max-new-tokens 64 \
        --runs 2 --timeout 600 --inprocess --name b7 --out "$OUT/b7.json"
      ;;
    b4c_profile)
      python3 bench/moe_batch_profile.py 2>>"$OUT/moe_stderr.log"
      ;;
    moe_kernels)
      python3 -m pytest -q -p no:cacheprovider tests/test_kernels.py -k "int4 or quant" \
        >"$OUT/moe_kernel_tests.log" 2>&1; tail -n 3 "$OUT/moe_kernel_tests.log"
      python3 bench/expert_dequant_bench.py 2>>"$OUT/moe_stderr.log"
      timeout 120 python3 bench/cpu_contention.py 2>>"$OUT/moe_stderr.log"
      ;;
    b4c_hf)
      timeout 540 python3 -m hybridgen.benchmarks.moe_bench --model qwen3-30b-a3b --budget-mb 12288 \
        --cases accelerate --out "$OUT/b4c_accelerate.json" 2>>"$OUT/moe_stderr.log"
      ;;
    b7_hf)
      timeout 300 python3 -m hybridgen.benchmarks.dense_offload_bench --model llama3-70b \
        --budget-mb 24576 --prompt-len 1024 --max-new-tokens 4 --layers 56 \
        --out "$OUT/b7_accelerate.json" 2>>"$OUT/dense_offload_stderr.log"
      ;;
    *) echo "usage: $0 [tests] [tests_wait] [b12] [b3a] [b4a] [b4c] [b4a_q4] [b4c_q4] [b4c_ab] [b4c_profile] [moe_kernels] [b4c_hf] [b7] [b7_hf] [speech]" >&2; exit 2 ;;
  esac
done
if [ -f "$OUT/load_stderr.log" ]; then tail -n 3 "$OUT/load_stderr.log"; fi
