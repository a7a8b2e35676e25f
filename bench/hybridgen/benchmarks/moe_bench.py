"""MoE with Cold-Weights within a GPU budget (BENCHMARKS.md B4), beside accelerate offloading.

    python -m hybridgen.benchmarks.moe_bench --model mixtral-8x7b --budget-mb 24576 \\
        --expert-format int4 --prompt-len 256 --new-tokens 64 [--cases NAMES] \\
        [--baseline-layers N] [--cpu-max-tokens N] [--out bench/results/moe.json]

Cases, each in its own process (`--in-process`: in this one), batch 1, greedy:
- uniform: the router as drawn;
- skewed: the router's logits biased toward two experts of each layer (SKEW), as routing on
  real text often is; the share of routed tokens those two take is reported;
- accelerate: HF transformers' model of the same shape (Mixtral, Qwen3-MoE), random bf16 weights,
  dispatched by accelerate within the same budget (`infer_auto_device_map`, the rest in host
  memory), --baseline-new-tokens tokens; --baseline-layers cuts its depth when the bf16
  model would not fit in host memory (said so in the results).
Ours run with Cold-Weights: experts in host memory in --expert-format and a device cache
sized from the budget (expert_cache_slots: auto); the CPU's experts go to an expert worker
over the shared arena (EXPERT_RUN), as the CPU daemon computes them under `hybridgen serve`,
here in a thread of this process. Each case reports decode tok/s, TTFT, the
cache hit rate, experts per step on each side, bytes copied per token and peak reserved GPU
memory, which must stay within the budget. The JSON file is written after every case and the
table printed last.
"""

from __future__ import annotations

import argparse
import gc
import json
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import structlog
import torch
from torch import Tensor

from hybridgen.benchmarks.accelerate_offload import build, place
from hybridgen.benchmarks.engine_bench import random_prompts
from hybridgen.benchmarks.hf_baseline import timed_generate
from hybridgen.benchmarks.report import machine_info
from hybridgen.config.engine import ConfigError, EngineConfig
from hybridgen.engine.engine import Engine, load_configured
from hybridgen.engine.host_memory import SHM_DIR, shm_free_bytes
from hybridgen.engine.memory import BudgetTooSmall
from hybridgen.experts.arena import arena_bytes
from hybridgen.experts.link import ExpertLinkClient, ExpertLinkWorker
from hybridgen.ipc import shm
from hybridgen.models.moe import SparseMoeBlock, moe_blocks
from hybridgen.models.presets import preset_spec
from hybridgen.runtime import log as hlog
from hybridgen.sampling.params import SamplingParams

log = structlog.get_logger()

CASES = ("uniform", "skewed", "accelerate")
TARGETS = {"mixtral-8x7b": 20.0, "mixtral-8x22b": 4.0, "qwen3-30b-a3b": 60.0}
"""Decode tok/s at batch 1 (BENCHMARKS.md B4; 8x22b's is the stated aim; qwen3-30b-a3b's is
B4c's at a 12 GB budget, issue 25)."""
SKEW = 3.0
"""Logit bias, in units of the router logits' standard deviation, for the two favoured
experts of each layer in case `skewed`."""


def _biased(logits: Callable[[Tensor], Tensor], bias: Tensor) -> Callable[[Tensor], Tensor]:
    return lambda x: logits(x) + bias


def skew_routing(blocks: list[SparseMoeBlock], hidden_size: int) -> None:
    """Bias each block's router toward experts layer % E and (layer + 1) % E: their logits
    gain SKEW times the router logits' standard deviation (the router weights' std times
    |x| ~ sqrt(hidden_size): the router's input is RMS-normed). Before the engine starts:
    its decode graphs capture the routers as they are then (moe_graphs.py)."""
    for layer, block in enumerate(blocks):
        n = block.num_experts
        weight = block.gate.weight
        bias = torch.zeros(n, dtype=weight.dtype, device=weight.device)
        spread = float(weight.detach().float().std()) * hidden_size**0.5
        bias[[layer % n, (layer + 1) % n]] = SKEW * spread
        block.router_logits = _biased(block.router_logits, bias)  # type: ignore[assignment]


def ours(args: argparse.Namespace, skewed: bool) -> dict[str, Any]:
    # The CPU's experts as under `hybridgen serve`: EXPERT_RUN to a worker (here a thread of
    # this process) over the shared expert arena, while the device runs the cached ones;
    # when /dev/shm cannot hold the arena, the engine's own thread computes them.
    spec = preset_spec(args.model)
    arena = arena_bytes(spec, args.expert_format, spec.moe_layer_count)
    room = shm_free_bytes()
    linked = room is None or arena <= room
    config = EngineConfig(
        model=args.model,
        device=args.device,
        gpu_memory_mb=args.budget_mb,
        max_model_len=args.prompt_len + args.new_tokens + 16,
        max_num_seqs=1,
        expert_cache_slots="auto",
        expert_format=args.expert_format,
        expert_cpu_max_tokens=args.cpu_max_tokens,
        shm_instance=f"moe{uuid.uuid4().hex[:10]}" if linked else None,
    )
    cuda = config.torch_device().type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    instance = config.shm_instance
    engine = worker = client = loaded = None
    try:
        loaded = load_configured(config)
        if skewed:
            skew_routing(moe_blocks(loaded.model), spec.hidden_size)
        engine = Engine(config, loaded)
        assert engine.experts is not None
        if instance is not None:
            worker, client = ExpertLinkWorker(instance), ExpertLinkClient(instance)
            worker.start()
            engine.experts[0].remote = client
        result = _decode(engine, args, cuda)
        result["cpu_experts_by"] = (
            "an expert worker over the shared arena"
            if linked
            else f"the engine's thread ({SHM_DIR} has {room} bytes free, the arena needs {arena})"
        )
        return result
    finally:
        if worker is not None and client is not None:
            worker.stop()
            client.close()
        if engine is not None:
            engine.release()
        if loaded is not None and loaded.expert_arena is not None:
            loaded.expert_arena.close()
        if instance is not None:
            shm.unlink_all(instance)


def _decode(engine: Engine, args: argparse.Namespace, cuda: bool) -> dict[str, Any]:
    """Batch-1 greedy decode of one random prompt, timed, with the Cold-Weights figures."""
    blocks = moe_blocks(engine.loaded.model)
    prompt, other = random_prompts(2, args.prompt_len, engine.spec.vocab_size, seed=1)
    warm = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    engine.generate([other], warm)  # compiles; shares no prefix with the timed prompt
    params = SamplingParams(temperature=0.0, max_tokens=args.new_tokens, ignore_eos=True)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    engine.add_request("moe", prompt, params)
    before = engine.moe_stats()
    start, first, tokens = time.perf_counter(), None, 0
    while engine.has_unfinished():
        outs = engine.step()
        sync()
        for o in outs:
            tokens += len(o.new_token_ids)
            if first is None and tokens:
                first = time.perf_counter()
    end = time.perf_counter()
    stats = engine.moe_stats()
    assert engine.experts is not None and first is not None
    cache = engine.experts[0]
    steps = max(tokens, 1)
    result: dict[str, Any] = {
        "expert_format": args.expert_format,
        "cache_slots": cache.capacity,
        "experts_total": len(blocks) * engine.spec.num_local_experts,
        "expert_mb": cache.expert_bytes / 2**20,
        "ttft_ms": (first - start) * 1e3,
        "decode_tok_s": (tokens - 1) / (end - first) if tokens > 1 else 0.0,
        "cache_hit_rate": _delta_rate(before, stats),
        "cpu_experts_per_token": (stats["cpu_experts"] - before["cpu_experts"]) / steps,
        "cpu_worker_experts": stats["cpu_daemon_experts"] - before["cpu_daemon_experts"],
        "gpu_experts_per_token": (stats["gpu_experts"] - before["gpu_experts"]) / steps,
        "mb_h2d_per_token": (stats["bytes_h2d"] - before["bytes_h2d"]) / steps / 2**20,
        "top2_share": stats["top2_share"],
        "latency_model": engine.experts[1].figures(),
    }
    if cuda:
        result["peak_reserved_mb"] = torch.cuda.max_memory_reserved() / 2**20
        result["within_budget"] = result["peak_reserved_mb"] <= args.budget_mb
    return result


def _delta_rate(before: dict[str, float], after: dict[str, float]) -> float:
    hits = after["cache_hits"] - before["cache_hits"]
    misses = after["cache_misses"] - before["cache_misses"]
    return hits / (hits + misses) if hits + misses else 0.0


def accelerate_case(args: argparse.Namespace) -> dict[str, Any]:
    """HF's model of the preset's shape (Mixtral, Qwen3-MoE) dispatched by accelerate in the
    same budget, a decoder layer never split; random bf16 weights (accelerate_offload.py)."""
    spec = preset_spec(args.model)
    layers = args.baseline_layers or spec.num_layers
    cuda = torch.cuda.is_available() and args.device != "cpu"
    off = build(place(replace(spec, num_layers=layers), args.budget_mb, cuda))
    ids = torch.tensor(random_prompts(1, args.prompt_len, spec.vocab_size, seed=1))
    ids = ids.to("cuda" if cuda else "cpu")
    ttft_s, tok_s = timed_generate(off.model, ids, args.baseline_new_tokens)
    result: dict[str, Any] = {
        "layers": layers,
        "shape": "same" if layers == spec.num_layers else f"{layers} of {spec.num_layers} layers",
        "dtype": str(off.dtype).removeprefix("torch."),
        "devices": off.devices,
        "ttft_ms": ttft_s * 1e3,
        "decode_tok_s": tok_s,
        "new_tokens": args.baseline_new_tokens,
    }
    if cuda:
        result["peak_reserved_mb"] = torch.cuda.max_memory_reserved() / 2**20
        result["within_budget"] = result["peak_reserved_mb"] <= args.budget_mb
    return result


def _one_case(args: argparse.Namespace, name: str) -> dict[str, Any]:
    try:
        if name == "accelerate":
            return accelerate_case(args)
        return ours(args, skewed=name == "skewed")
    except (BudgetTooSmall, ConfigError, torch.OutOfMemoryError, RuntimeError, ImportError) as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}
    finally:
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def child_argv(argv: list[str], name: str, out: Path) -> list[str]:
    """The arguments for one case's process: ours without --cases and --out (in either
    `--out X` or `--out=X` form), plus that case, its own output and --in-process."""
    keep: list[str] = []
    skip_value = False
    for a in argv:
        if skip_value:
            skip_value = False
        elif a in ("--cases", "--out"):
            skip_value = True
        elif not a.startswith(("--cases=", "--out=")):
            keep.append(a)
    return ["--in-process", *keep, f"--cases={name}", f"--out={out}"]


def _isolated(args: argparse.Namespace, name: str, argv: list[str]) -> dict[str, Any]:
    """One case in a child process, so that each starts with the whole budget free."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "case.json"
        cmd = [sys.executable, "-m", "hybridgen.benchmarks.moe_bench", *child_argv(argv, name, out)]
        proc = subprocess.run(cmd, stdout=subprocess.DEVNULL, check=False)
        if not out.exists():
            return {"error": f"the case's process exited with code {proc.returncode}"}
        return dict(json.loads(out.read_text())["cases"][name])


def print_table(result: dict[str, Any]) -> None:
    print(
        f"\nB4 moe: model={result['model']} experts={result['expert_format']} "
        f"budget={result['budget_mb']} MiB commit={result['machine']['commit']}"
    )
    head = ("decode tok/s", "TTFT ms", "hit rate", "top-2", "MB/token", "peak MiB")
    print(f"{'case':11} " + " ".join(f"{h:>12}" for h in head) + "  note")
    for name, r in result["cases"].items():
        if "error" in r:
            print(f"{name:11} {r['error'][:90]}")
            continue
        cells = [
            f"{r['decode_tok_s']:12.2f}",
            f"{r['ttft_ms']:12.0f}",
            f"{r['cache_hit_rate']:12.1%}" if "cache_hit_rate" in r else f"{'-':>12}",
            f"{r['top2_share']:12.1%}" if "top2_share" in r else f"{'-':>12}",
            f"{r['mb_h2d_per_token']:12.1f}" if "mb_h2d_per_token" in r else f"{'-':>12}",
            f"{r.get('peak_reserved_mb', 0):12.0f}",
        ]
        note = r.get("shape", "")
        if name != "accelerate" and result["model"] in TARGETS:
            note = f"target >= {TARGETS[result['model']]:g}"
        print(f"{name:11} " + " ".join(cells) + f"  {note}")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--model", default="mixtral-8x7b")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--budget-mb", type=int, default=24576)
    ap.add_argument("--expert-format", choices=("native", "int8", "int4"), default="int4")
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--baseline-new-tokens", type=int, default=4)
    ap.add_argument("--baseline-layers", type=int, default=None, help="cut the HF baseline")
    ap.add_argument(
        "--cpu-max-tokens", type=int, default=None, help="pin the CPU-or-fetch crossover"
    )
    ap.add_argument("--cases", type=lambda s: s.split(","), default=list(CASES))
    ap.add_argument("--out", type=Path, default=Path("bench/results/moe.json"))
    ap.add_argument("--in-process", action="store_true", help="no child process per case")
    return ap


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = build_parser()
    argv = sys.argv[1:] if argv is None else argv
    args = ap.parse_args(argv)
    unknown = sorted(set(args.cases) - set(CASES))
    if unknown:
        ap.error(f"argument --cases: unknown {unknown}; allowed {', '.join(CASES)}")
    if args.prompt_len < 2 or args.new_tokens < 2 or args.baseline_new_tokens < 2:
        ap.error("need --prompt-len, --new-tokens and --baseline-new-tokens >= 2")
    hlog.configure()
    result: dict[str, Any] = {
        "machine": machine_info(),
        "command": " ".join(["python -m hybridgen.benchmarks.moe_bench", *argv]),
        "model": args.model,
        "synthetic": preset_spec(args.model).synthetic,
        "expert_format": args.expert_format,
        "budget_mb": args.budget_mb,
        "prompt_len": args.prompt_len,
        "targets_decode_tok_s": TARGETS,
        "cases": {},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    for name in args.cases:
        log.info("moe_case", case=name)
        one = _one_case(args, name) if args.in_process else _isolated(args, name, argv)
        result["cases"][name] = one
        args.out.write_text(json.dumps(result, indent=2, default=str) + "\n")
    print_table(result)
    return result


if __name__ == "__main__":
    main()
