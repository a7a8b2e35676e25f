"""Long contexts within a GPU budget (BENCHMARKS.md B3): the KV tiers against the baselines.

    python -m hybridgen.benchmarks.umv_bench --model llama3-8b --context-len 131072 \\
        --new-tokens 64 --budget-mb 24576 --out bench/results/umv.json

Cases, each a fresh engine on the same weights (loaded once), with the budget enforced by
the engine's allocator cap:
- b3a: one sequence, int4 KV: all in an int4 Hot cache; b3a_warm: native Hot, int4 Warm;
- b3b_<mode>: one sequence, exact: native Hot, lossless Warm, for attn_warm cpu, gpu, split
  (its share re-balanced from live timings, as a served engine does) and auto (measured at
  start);
- b3b_drafts<k>: b3b_gpu with kv_cache.warm_draft_tokens k, for each k of --draft-tokens:
  k drafts attending Hot alone, checked over Hot and Warm in one step (warm_drafts.py);
- b3c: four sequences at once, int4 Hot and int4 Warm: each fits Hot alone, so they take
  turns there of --turn-tokens (kv_cache.hot_turn_tokens), swapped to Warm between turns as they
  are; b3c_kivi: native Hot and int4 Warm (KIVI's per-channel keys), read in place by the
  device at every step; b3c_pure_gpu: int4 Hot alone, which must fit or fail cleanly;
- pure_gpu: native Hot and no Warm, in the budget: it fits or fails with the engine's error;
- unbudgeted: native Hot, no budget: the ceiling;
- hf: HF transformers (offloaded cache on CUDA), one sequence, --hf-new-tokens tokens.
Each reports TTFT (the last sequence's first token), decode tok/s over the steps where all
its sequences decode together, peak reserved GPU memory and the tier figures. A case that
fails records its error and the run goes on. Writes the JSON file after every case and
prints the table last.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import structlog
import torch

from hybridgen.benchmarks.engine_bench import random_prompts
from hybridgen.benchmarks.report import machine_info
from hybridgen.config.engine import ConfigError, EngineConfig
from hybridgen.engine.engine import Engine
from hybridgen.engine.memory import BudgetTooSmall
from hybridgen.kvtiers.warm_tier import warm_mb_for
from hybridgen.models.loader import LoadedModel, load_model, to_hf_state_dict
from hybridgen.runtime import log as hlog
from hybridgen.sampling.params import SamplingParams

log = structlog.get_logger()

TARGETS = {"b3a": 60.0, "b3b": 10.0, "b3c": 25.0}
"""Decode tok/s targets (BENCHMARKS.md B3); b3b holds for its best attn_warm mode."""


def cases(args: argparse.Namespace) -> dict[str, tuple[int, dict[str, Any]]]:
    """name -> (sequences, EngineConfig overrides)."""
    budget, turn = {"gpu_memory_mb": args.budget_mb}, args.turn_tokens
    exact = {**budget, "warm_codec": "lossless"}
    out: dict[str, tuple[int, dict[str, Any]]] = {
        "b3a": (1, {**budget, "hot_codec": "int4", "warm": False}),
        "b3a_warm": (1, {**budget, "warm_codec": "int4"}),
        **{f"b3b_{m}": (1, {**exact, "attn_warm": m}) for m in ("cpu", "gpu", "auto")},
        # The start-up probe's share is a first guess; live timings re-balance it while serving.
        "b3b_split": (1, {**exact, "attn_warm": "split", "dynamic_tuning": True}),
        **{
            f"b3b_drafts{k}": (1, {**exact, "attn_warm": "gpu", "warm_draft_tokens": k})
            for k in args.draft_tokens
        },
        "b3c": (4, {**budget, "hot_codec": "int4", "warm_codec": "int4", "hot_turn_tokens": turn}),
        "b3c_kivi": (4, {**budget, "warm_codec": "int4"}),
        "b3c_pure_gpu": (4, {**budget, "hot_codec": "int4", "warm": False}),
        "pure_gpu": (1, {**budget, "warm": False}),
        "unbudgeted": (1, {"warm": False}),
    }
    return {k: v for k, v in out.items() if not args.cases or k in args.cases}


def run_case(
    loaded: LoadedModel, args: argparse.Namespace, seqs: int, options: dict[str, Any]
) -> dict[str, Any]:
    # Prefills run one after another; an earlier sequence decodes through the later ones'
    # prefills, so it asks for more tokens and all `seqs` then decode together for the
    # last --new-tokens steps, which are the ones timed (those between the last sequence's
    # first token and the first finish: with turns in Hot, four sequences take turns there).
    prefill_steps = -(-args.context_len // args.chunk) + 1
    spec = loaded.model.spec
    length = args.context_len + args.new_tokens + (seqs - 1) * prefill_steps
    warm = options.pop("warm", True)
    config = EngineConfig(
        model=args.model,
        device=args.device,
        max_num_seqs=seqs,
        max_model_len=length + 16,
        max_num_batched_tokens=args.chunk,
        prefix_reuse=False,
        # Whole chunks beside decodes: the timing plan above counts one chunk a step, and B3
        # is about long-context capacity, not the gaps decode-first steps bound.
        step_latency_ms=0.0,
        **options,
    )
    if warm:
        tokens = seqs * length
        config = EngineConfig(
            **{
                **asdict(config),
                "warm_pool_mb": warm_mb_for(
                    spec, config.warm_codec, config.block_size, tokens, config.hot_codec
                ),
            }
        )
    cuda = config.torch_device().type == "cuda"
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    engine = Engine(config, loaded=loaded)
    try:
        prompts = random_prompts(seqs, args.context_len, spec.vocab_size, seed=seqs)
        sync = torch.cuda.synchronize if cuda else (lambda: None)
        start = time.perf_counter()
        for i, p in enumerate(prompts):
            extra = (seqs - 1 - i) * prefill_steps
            params = SamplingParams(
                temperature=0.0, max_tokens=args.new_tokens + extra, ignore_eos=True
            )
            engine.add_request(f"umv-{i}", p, params)
        first: dict[str, float] = {}
        steps: list[tuple[float, float, int, list[str]]] = []  # t0, t1, tokens, who
        finished_at = float("inf")
        while engine.has_unfinished():
            t0 = time.perf_counter()
            outs = engine.step()
            sync()
            t1 = time.perf_counter()
            steps.append(
                (
                    t0 - start,
                    t1 - start,
                    sum(len(o.new_token_ids) for o in outs),
                    [o.request_id for o in outs if o.new_token_ids],
                )
            )
            for o in outs:
                first.setdefault(o.request_id, t1 - start)
                if o.finished:
                    finished_at = min(finished_at, t1 - start)
        decode_tokens, decode_s, gap = _decode_window(steps, max(first.values()), finished_at)
        result: dict[str, Any] = {
            "sequences": seqs,
            "config": {k: v for k, v in asdict(config).items() if k != "model"},
            "ttft_ms": max(first.values()) * 1e3,
            "decode_tok_s": decode_tokens / decode_s if decode_s else 0.0,
            "max_token_gap_ms": gap * 1e3,
            "all_at_once": decode_s > 0,
            "e2e_tok_s": sum(s[2] for s in steps) / steps[-1][1],
            "turns_in_hot": engine.scheduler.turns_ended,
            "hot_blocks": engine.plan.num_blocks,
            "tiers": engine.tier_stats(),
        }
        if engine.drafts.tokens:
            d = engine.drafts.stats
            result["drafts"] = {**asdict(d), "acceptance": d.acceptance}
        if engine.warm is not None:
            result["attn_warm"] = {"mode": engine.warm.mode, "cpu_share": engine.warm.split}
        if cuda:
            result["peak_reserved_mb"] = torch.cuda.max_memory_reserved() / 2**20
        return result
    finally:
        engine.release()
        del engine
        gc.collect()  # a failed case's frames must not hold the next case's memory
        if cuda:
            torch.cuda.empty_cache()


def _decode_window(
    steps: list[tuple[float, float, int, list[str]]], begin: float, end: float
) -> tuple[int, float, float]:
    """Decoding with every sequence started and none finished: the steps from the last
    first token to the first finish -> (tokens, seconds, the longest any one sequence went
    without a token in that window: the wait between turns in Hot, if they take turns)."""
    inside = [s for s in steps if s[0] >= begin and s[1] <= end]
    last: dict[str, float] = {}
    gap = 0.0
    for _, t1, _, who in inside:
        for rid in who:
            gap = max(gap, t1 - last.get(rid, begin))
            last[rid] = t1
    return sum(s[2] for s in inside), sum(s[1] - s[0] for s in inside), gap


def hf_case(loaded: LoadedModel, args: argparse.Namespace) -> dict[str, Any]:
    """HF transformers on the same weights, one sequence; the offloaded cache on CUDA."""
    from hybridgen.benchmarks.hf_baseline import HFBaseline, timed_generate

    spec, device = loaded.model.spec, loaded.model.embed_tokens.weight.device
    weights = {k: v.to("cpu") for k, v in to_hf_state_dict(loaded.model).items()}
    hf = HFBaseline(spec, weights, device)
    del weights
    cache = "offloaded" if device.type == "cuda" else None
    ids = torch.tensor(random_prompts(1, args.context_len, spec.vocab_size, seed=1), device=device)
    ttft_s, tok_s = timed_generate(hf.model, ids, args.hf_new_tokens, cache)
    del hf
    return {
        "cache_implementation": cache or "default",
        "ttft_ms": ttft_s * 1e3,
        "decode_tok_s": tok_s,
        "new_tokens": args.hf_new_tokens,
    }


def _one_case(loaded: LoadedModel, args: argparse.Namespace, name: str) -> dict[str, Any]:
    """A case's figures, or the error that stopped it."""
    try:
        if name == "hf":
            return hf_case(loaded, args)
        seqs, options = cases(args)[name]
        return run_case(loaded, args, seqs, dict(options))
    except (BudgetTooSmall, ConfigError, torch.OutOfMemoryError, RuntimeError) as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}


def _isolated(args: argparse.Namespace, name: str) -> dict[str, Any]:
    """One case in a child process: the device memory of a case that failed halfway is
    returned at the child's exit instead of shrinking the next case's budget."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "case.json"
        argv = [
            *(f"--model={args.model}", f"--device={args.device}"),
            *(f"--context-len={args.context_len}", f"--new-tokens={args.new_tokens}"),
            *(f"--budget-mb={args.budget_mb}", f"--chunk={args.chunk}"),
            *(f"--hf-new-tokens={args.hf_new_tokens}", f"--cases={name}", f"--out={out}"),
            f"--turn-tokens={args.turn_tokens}",
            f"--draft-tokens={','.join(map(str, args.draft_tokens))}",
        ]
        cmd = [sys.executable, "-m", "hybridgen.benchmarks.umv_bench", "--in-process", *argv]
        proc = subprocess.run(cmd, stdout=subprocess.DEVNULL, check=False)  # stderr: progress
        if not out.exists():
            return {"error": f"the case's process exited with code {proc.returncode}"}
        child: dict[str, Any] = json.loads(out.read_text())
    return dict(child["cases"][name])


def print_table(result: dict[str, Any]) -> None:
    print(
        f"\nB3 umv: model={result['model']} context={result['context_len']} "
        f"budget={result['budget_mb']} MiB commit={result['machine']['commit']}"
    )
    print(f"{'case':12} {'TTFT ms':>10} {'decode tok/s':>13} {'peak MiB':>9} {'hot hit':>8}  note")
    for name, r in result["cases"].items():
        if "error" in r:
            print(f"{name:12} {'-':>10} {'-':>13} {'-':>9} {'-':>8}  {r['error'][:60]}")
            continue
        target = TARGETS.get(name.split("_")[0])
        note = "" if target is None else f"target >= {target:g}"
        if not r.get("all_at_once", True):
            note = f"never all at once; {r['e2e_tok_s']:.2f} tok/s end to end"
        elif "drafts" in r:
            d = r["drafts"]
            note += f"; {d['accepted']}/{d['drafted']} drafts kept in {d['rounds']} checks"
        elif r.get("turns_in_hot"):
            note += f"; {r['turns_in_hot']} turns in Hot, gap <= {r['max_token_gap_ms']:.0f} ms"
        hit = r.get("tiers", {}).get("hot_hit_rate")
        print(
            f"{name:12} {r['ttft_ms']:10.0f} {r['decode_tok_s']:13.2f} "
            f"{r.get('peak_reserved_mb', 0):9.0f} {'' if hit is None else f'{hit:.1%}':>8}  {note}"
        )


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--model", default="llama3-8b")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--context-len", type=int, default=131072)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--budget-mb", type=int, default=24576)
    ap.add_argument("--chunk", type=int, default=2048, help="prefill tokens per step")
    ap.add_argument(
        "--cases",
        type=lambda s: s.split(","),
        default=None,
        help="comma list of case names (module docstring, and hf), e.g. b3a,b3b_gpu,hf "
        "(default: all)",
    )
    ap.add_argument("--hf-new-tokens", type=int, default=8)
    ap.add_argument("--turn-tokens", type=int, default=16, help="b3c's kv_cache.hot_turn_tokens")
    ap.add_argument(
        "--draft-tokens",
        type=lambda s: [int(k) for k in s.split(",")],
        default=[8],
        help="comma list: a b3b_drafts<k> case for each (kv_cache.warm_draft_tokens)",
    )
    ap.add_argument("--out", type=Path, default=Path("bench/results/umv.json"))
    ap.add_argument(
        "--in-process",
        action="store_true",
        help="run the cases in this process (default: each in a child process)",
    )
    args = ap.parse_args(argv)
    if args.context_len < 16 or args.new_tokens < 2 or args.hf_new_tokens < 2:
        ap.error("need --context-len >= 16, --new-tokens >= 2, --hf-new-tokens >= 2")
    if args.turn_tokens < 1:
        ap.error("need --turn-tokens >= 1")
    hlog.configure()
    # The budget is a cap on what the allocator reserves, so fragmentation must not eat it.
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    names = [*cases(args), *(["hf"] if not args.cases or "hf" in args.cases else [])]
    result: dict[str, Any] = {
        "machine": machine_info(),
        "command": " ".join(["python -m hybridgen.benchmarks.umv_bench", *sys.argv[1:]]),
        "model": args.model,
        "context_len": args.context_len,
        "new_tokens": args.new_tokens,
        "budget_mb": args.budget_mb,
        "targets_decode_tok_s": TARGETS,
        "cases": {},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    if args.in_process:
        device = EngineConfig(device=args.device).torch_device()
        loaded = load_model(args.model, device, None, 0)
        result["synthetic"] = loaded.model.spec.synthetic
        for name in names:
            log.info("umv_case", case=name)
            result["cases"][name] = _one_case(loaded, args, name)
            args.out.write_text(json.dumps(result, indent=2, default=str) + "\n")
    else:
        for name in names:
            log.info("umv_case", case=name)
            result["cases"][name] = _isolated(args, name)
            args.out.write_text(json.dumps(result, indent=2, default=str) + "\n")
    print_table(result)
    return result


if __name__ == "__main__":
    main()
