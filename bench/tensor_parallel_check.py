"""Tensor parallel against one device, in one process per setting (issue 24, point 2):
greedy tokens of a fixed prompt set at each --tp, their agreement with the first setting's,
and the B1 / B2 shapes in process: batch 1 (prompt 512, 256 new tokens: decode tok/s and
TTFT) and 64 sequences at once (prompt 512, 256 new: tok/s in all).

    python bench/tensor_parallel_check.py --model llama3-8b --tp 1 2 --device cuda \
        [--out bench/results/tensor_parallel_llama3-8b.json] [--skip-b2]

On the CPU (--device cpu, a tiny model) it checks the script itself: gloo stands in for NCCL.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from hybridgen.config.engine import EngineConfig
from hybridgen.engine.engine import Engine
from hybridgen.sampling.params import SamplingParams

PROMPTS = 8
"""Fixed prompts of the agreement check (token ids drawn with seed 0)."""


def prompt_ids(vocab: int, n: int, length: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (length,), generator=gen).tolist() for _ in range(n)]


def timed(engine: Engine, prompts: list[list[int]], new: int) -> dict[str, float]:
    """All `prompts` at once, `new` tokens each: seconds to the first token and after it."""
    params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"t{i}", prompt, params)
    start, first, tokens = time.perf_counter(), None, 0
    while engine.has_unfinished():
        for out in engine.step():
            tokens += len(out.new_token_ids)
            if first is None and out.new_token_ids:
                first = time.perf_counter()
    end = time.perf_counter()
    assert first is not None
    decode = tokens - len(prompts)
    return {
        "ttft_ms": round((first - start) * 1e3, 2),
        "decode_tok_s": round(decode / (end - first), 1),
        "total_tok_s": round(tokens / (end - start), 1),
    }


def run(args: argparse.Namespace, tp: int) -> dict[str, object]:
    config = EngineConfig(
        model=args.model,
        device=args.device,
        tensor_parallel=tp,
        max_num_seqs=64,
        max_model_len=1024,
    )
    engine = Engine(config)
    try:
        vocab = engine.spec.vocab_size
        greedy = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True)
        fixed = prompt_ids(vocab, PROMPTS, 64, 0)
        tokens = [c.token_ids for c in engine.generate(fixed, greedy)]
        timed(engine, prompt_ids(vocab, 1, 512, 1), 16)  # warm-up
        result: dict[str, object] = {"tp": tp, "tokens": tokens}
        result["b1"] = timed(engine, prompt_ids(vocab, 1, 512, 2), 256)
        if not args.skip_b2:
            result["b2"] = timed(engine, prompt_ids(vocab, 64, 512, 3), 256)
    finally:
        engine.release()
    return result


def agreement(a: list[list[int]], b: list[list[int]]) -> float:
    """Share of positions where b's greedy token equals a's, up to each pair's first miss."""
    same = 0
    for x, y in zip(a, b, strict=True):
        n = next((i for i, (p, q) in enumerate(zip(x, y, strict=True)) if p != q), len(x))
        same += n
    return same / sum(len(x) for x in a)


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--model", default="llama3-8b")
    ap.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tokens", type=int, default=32, help="greedy tokens per fixed prompt")
    ap.add_argument("--skip-b2", action="store_true")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    results = [run(args, tp) for tp in args.tp]
    base = results[0]["tokens"]
    for r in results:
        r["agreement_with_first"] = agreement(base, r["tokens"])  # type: ignore[arg-type]
        r["identical_to_first"] = r["tokens"] == base
    summary = [{k: v for k, v in r.items() if k != "tokens"} for r in results]
    print(json.dumps(summary, indent=2))
    if args.out is not None:
        args.out.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
