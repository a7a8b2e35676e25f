"""How often a model attending quantized KV picks exact KV's greedy token: the acceptance
drafts over such KV would get from kv_cache.warm_draft_tokens' check step (device tool).

    python bench/draft_agreement.py --context-len 131072 --tokens 48 --out $OUT/agreement.json

One random prompt; the native (exact) engine's greedy continuation is the reference. Each
codec's engine then predicts every reference token from the prompt plus the reference tokens
before it (teacher-forced: each prediction a 1-token request on the cached prefix), and its
free-running continuation is compared too. Unbudgeted, so only the KV codec differs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

import structlog

from hybridgen.benchmarks.engine_bench import random_prompts
from hybridgen.benchmarks.report import machine_info
from hybridgen.config.engine import EngineConfig
from hybridgen.engine.engine import Engine
from hybridgen.models.loader import LoadedModel, load_model
from hybridgen.runtime import log
from hybridgen.sampling.params import SamplingParams


def greedy(engine: Engine, prompt: list[int], n: int) -> list[int]:
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    return engine.generate([prompt], params)[0].token_ids


def engine_for(loaded: LoadedModel, args: argparse.Namespace, codec: str) -> Engine:
    length = args.context_len + args.tokens + 64
    config = EngineConfig(
        model=args.model,
        device=args.device,
        max_num_seqs=1,
        max_model_len=length,
        max_num_batched_tokens=1024,
        hot_codec=codec,
        num_kv_blocks=length // 16 + 8,  # the rest of the device is the prefill's workspace
    )
    return Engine(config, loaded=loaded)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--model", default="llama3-8b")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--context-len", type=int, default=131072)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--codecs", default="int4,int8")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    log.configure()
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    loaded = load_model(args.model, EngineConfig(device=args.device).torch_device(), None, 0)
    prompt = random_prompts(1, args.context_len, loaded.model.spec.vocab_size, seed=1)[0]
    engine = engine_for(loaded, args, "native")
    reference = greedy(engine, prompt, args.tokens)
    engine.release()
    result: dict[str, Any] = {
        "machine": machine_info(),
        "command": " ".join(["python bench/draft_agreement.py", *sys.argv[1:]]),
        "model": args.model,
        "context_len": args.context_len,
        "reference": reference,
        "codecs": {},
    }
    progress = structlog.get_logger()
    for codec in args.codecs.split(","):
        engine = engine_for(loaded, args, codec)
        free = greedy(engine, prompt, args.tokens)
        forced = []
        for j in range(args.tokens):
            forced += greedy(engine, prompt + reference[:j], 1)
            progress.info("teacher_forced", codec=codec, done=j + 1, total=args.tokens)
        engine.release()
        agree = sum(a == b for a, b in zip(forced, reference, strict=True)) / args.tokens
        first = next(
            (i for i, (a, b) in enumerate(zip(free, reference, strict=True)) if a != b), len(free)
        )
        result["codecs"][codec] = {
            "teacher_forced_agreement": agree,
            "free_running_first_divergence": first,
            "forced": forced,
        }
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\ndraft agreement: {args.model}, context {args.context_len}, {args.tokens} tokens")
    print(f"{'KV codec':10} {'teacher-forced':>15} {'first divergence':>17}")
    for codec, r in result["codecs"].items():
        print(
            f"{codec:10} {r['teacher_forced_agreement']:15.1%} "
            f"{r['free_running_first_divergence']:17d}"
        )
    return result


if __name__ == "__main__":
    main()
