"""Engine benchmark (BENCHMARKS.md B1 and the batch sweep), with HF transformers beside it.

    python -m hybridgen.benchmarks.engine_bench --model llama3-8b --out bench/results/engine.json
    python -m hybridgen.benchmarks.engine_bench --model llama3-8b --weights-format int4 \
        --batches 1 --out bench/results/engine_int4_h200.json      # B1 with int4 weights

Runs our engine and HF transformers on the same synthetic weights in one process: TTFT and
decode tok/s at batch 1, total tok/s over a batch sweep, and the bf16 logits check against
HF (the same weights in transformers, bf16 and fp32). Every figure is the median of --runs
timed runs after a warm-up; compilation and CUDA-graph capture happen before timing.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import structlog
import torch

from hybridgen.benchmarks.hf_baseline import HFBaseline
from hybridgen.benchmarks.report import machine_info, print_table
from hybridgen.benchmarks.server_time import run_passes
from hybridgen.config.engine import EngineConfig
from hybridgen.engine.engine import Engine
from hybridgen.engine.info import pass_info
from hybridgen.models.loader import to_hf_state_dict
from hybridgen.runtime import log as hlog
from hybridgen.sampling.params import SamplingParams

log = structlog.get_logger()


@dataclass
class RunTiming:
    ttft_s: float
    """Submission to the first token of the last request to get one."""
    decode_tok_s: float
    """Tokens from decode-only steps over the time of those steps."""
    total_tok_s: float
    """All generated tokens over the wall time of the run."""


def random_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n, length), generator=g).tolist()


def timed_run(engine: Engine, prompts: list[list[int]], new_tokens: int) -> RunTiming:
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    sync = torch.cuda.synchronize if engine.device.type == "cuda" else (lambda: None)
    sync()
    start = time.perf_counter()
    for i, p in enumerate(prompts):
        engine.add_request(f"bench-{start}-{i}", p, params)
    first: dict[str, float] = {}
    decode_tokens, decode_time, total = 0, 0.0, 0
    while engine.has_unfinished():
        t0 = time.perf_counter()
        outs = engine.step()
        t1 = time.perf_counter()
        if outs and all(o.output_tokens > len(o.new_token_ids) for o in outs):
            decode_tokens += sum(len(o.new_token_ids) for o in outs)
            decode_time += t1 - t0
        for o in outs:
            first.setdefault(o.request_id, t1)
            total += len(o.new_token_ids)
    wall = time.perf_counter() - start
    return RunTiming(
        ttft_s=max(first.values()) - start,
        decode_tok_s=decode_tokens / decode_time if decode_time else 0.0,
        total_tok_s=total / wall,
    )


def median_runs(engine: Engine, prompts: list[list[int]], new_tokens: int, runs: int) -> dict:
    """Medians of `runs` timed runs after a warm-up, and the engine's forward passes over
    all of them by phase (server_time.run_passes: count, mean ms, decode rows, prompt
    tokens), as a served run reports them."""
    timed_run(engine, prompts, min(new_tokens, 8))  # warm-up
    counted, seconds = pass_info(engine.stats.passes), dict(engine.stats.seconds)
    results = [timed_run(engine, prompts, new_tokens) for _ in range(runs)]
    spent = {p: s - seconds[p] for p, s in engine.stats.seconds.items()}
    return {
        "ttft_ms": statistics.median(r.ttft_s for r in results) * 1e3,
        "decode_tok_s": statistics.median(r.decode_tok_s for r in results),
        "total_tok_s": statistics.median(r.total_tok_s for r in results),
        "runs": len(results),
        "passes": run_passes(counted, pass_info(engine.stats.passes), spent),
    }


def hf_phase(
    engine: Engine,
    args: argparse.Namespace,
    check_prompts: list[list[int]],
    ours_logits: list[torch.Tensor],
) -> dict[str, Any]:
    """Free our engine, load its exact weights into transformers, time it and compare logits."""
    weights = {k: v.to("cpu") for k, v in to_hf_state_dict(engine.loaded.model).items()}
    spec, vocab, device = engine.spec, engine.spec.vocab_size, engine.device
    engine.release()
    hf = HFBaseline(spec, weights, device)
    del weights
    timings = {}
    for b in args.batches:
        log.info("bench_batch", engine="transformers", batch=b)
        prompts = random_prompts(b, args.prompt_len, vocab, seed=b)
        timings[str(b)] = hf.timed(prompts, args.hf_new_tokens, args.runs)
    bf16 = [hf.prompt_logits(p) for p in check_prompts]
    hf.to_fp32()
    fp32 = [hf.prompt_logits(p) for p in check_prompts]

    def rel(a: torch.Tensor, b: torch.Tensor) -> float:
        return float((a - b).norm() / b.norm())

    rows = [
        {
            "prompt_len": len(p),
            "rel_err_vs_hf_bf16": rel(o, h),
            "rel_err_vs_hf_fp32": rel(o, x),
            "hf_bf16_rel_err_vs_hf_fp32": rel(h, x),
            "top1_agrees_with_hf_bf16": bool(o.argmax() == h.argmax()),
            "top1_agrees_with_hf_fp32": bool(o.argmax() == x.argmax()),
        }
        for p, o, h, x in zip(check_prompts, ours_logits, bf16, fp32, strict=True)
    ]
    return {"timings": timings, "logits_check": rows}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--model", default="llama3-8b")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument(
        "--batches", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8, 32, 64]
    )
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--gpu-memory-mb", type=int, default=None)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--hot-codec", choices=("native", "int8", "int4"), default="native")
    ap.add_argument(
        "--weights-format",
        choices=("native", "int8", "int4"),
        default="native",
        help="dense weights on the device (weights.format); --hf needs native",
    )
    ap.add_argument("--hf", action="store_true", help="run HF transformers on the same weights")
    ap.add_argument("--hf-new-tokens", type=int, default=32)
    ap.add_argument("--out", type=Path, default=Path("bench/results/engine.json"))
    args = ap.parse_args(argv)
    if args.hf and args.weights_format != "native":
        ap.error("--hf loads our exact weights into transformers: use --weights-format native")
    hlog.configure()
    config = EngineConfig(
        model=args.model,
        gpu_memory_mb=args.gpu_memory_mb,
        max_num_seqs=max(args.batches),
        max_model_len=args.max_model_len,
        max_graph_batch=max(args.batches),
        hot_codec=args.hot_codec,
        weights_format=args.weights_format,
        # Every timed run repeats the warm-up's prompts: a prefix cache would serve them and
        # TTFT would no longer time the prefill. Prefix reuse has its own benchmark.
        prefix_reuse=False,
    )
    engine = Engine(config)
    vocab = engine.spec.vocab_size
    result: dict[str, Any] = {
        "machine": machine_info(),
        "command": " ".join(sys.argv),
        "model": args.model,
        "synthetic": engine.spec.synthetic,
        "config": asdict(config),
        "memory_plan": engine.plan.summary(),
        "ours": {},
    }
    for b in args.batches:
        log.info("bench_batch", engine="hybridgen", batch=b)
        prompts = random_prompts(b, args.prompt_len, vocab, seed=b)
        result["ours"][str(b)] = median_runs(engine, prompts, args.new_tokens, args.runs)
    if engine.device.type == "cuda":
        result["peak_reserved_mb"] = torch.cuda.max_memory_reserved() / 2**20
    check_prompts = [random_prompts(1, n, vocab, seed=100 + n)[0] for n in (16, 128, 512)]
    ours_logits = [engine.prompt_logits(p).cpu() for p in check_prompts]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2, default=str) + "\n")
    if args.hf:
        result["hf"] = hf_phase(engine, args, check_prompts, ours_logits)
        args.out.write_text(json.dumps(result, indent=2, default=str) + "\n")
    print_table(result)


if __name__ == "__main__":
    main()
