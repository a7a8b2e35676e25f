"""Offline profile of the switchable op-regions: replay a prompt file, time each region on each
device at the live shapes, and write tuning_profile.json (format:
placement/tuning_profile.py).

    hybridgen-profiler --prompt-file prompts.jsonl [--model M] [--config FILE] \\
        [--device auto|cpu|cuda] [--max-new-tokens N] [--out tuning_profile.json]

(or `python -m hybridgen.tools.profiler ...`). The engine is built in this process from the
config, as the GPU daemon builds it. Every prompt of the file (e2e_benchmark's format: JSON
lines {"prompt": ..., "max_new_tokens": optional}) runs greedy, ignoring EOS, with the
scheduler keeping max_num_seqs running as a server would; the replay records the decode batch
sizes, prompt lengths, Warm blocks per decoding sequence and the KV tier figures. Then each
switchable region is timed both ways at the typical shapes (best of --runs) and the bytes
crossing PCIe per step are counted, as placement/region_timing.py describes: attn_warm,
sample and kv_codec.

attn_warm and kv_codec need a Warm tier (kv_cache.warm_region_mb). On a CPU-only
machine both "devices" are the CPU: both code paths are still timed and the file says
"device": "cpu". Point the config's profile_path at the file to serve with it.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import structlog
import torch

from hybridgen.benchmarks.e2e_benchmark import int_range
from hybridgen.benchmarks.prompt_file import Prompt, load_prompts
from hybridgen.benchmarks.report import git_commit, machine_info
from hybridgen.config.engine import ConfigError
from hybridgen.config.file import load_config
from hybridgen.engine.engine import Engine
from hybridgen.engine.memory import BudgetTooSmall
from hybridgen.engine.validation import InvalidRequest
from hybridgen.placement.region_timing import (
    NoWarmRoom,
    profile_attn_warm,
    profile_kv_codec,
    profile_sample,
)
from hybridgen.placement.tuning_profile import TuningProfile, save_profile
from hybridgen.runtime import log as hlog
from hybridgen.sampling.params import InvalidSamplingParameter, SamplingParams

log = structlog.get_logger()


class ProfilerError(Exception):
    """The replay cannot run as asked; the message says what to change."""


@dataclasses.dataclass
class Shapes:
    """What the replay saw, step by step (sampled before each step)."""

    prompt_lens: list[int] = dataclasses.field(default_factory=list)
    decode_batches: list[int] = dataclasses.field(default_factory=list)
    """Sequences decoding, per step that decoded any."""
    warm_rows: list[int] = dataclasses.field(default_factory=list)
    """Decoding sequences with Warm blocks, per step that had any."""
    warm_blocks: list[int] = dataclasses.field(default_factory=list)
    """Warm blocks of each such sequence, per step."""

    def observe(self, engine: Engine) -> None:
        decoding = [s for s in engine.scheduler.running if s.num_output_tokens > 0]
        if decoding:
            self.decode_batches.append(len(decoding))
        warm = [len(s.warm_slots) for s in decoding if s.warm_slots]
        if warm:
            self.warm_rows.append(len(warm))
            self.warm_blocks += warm

    def summary(self, engine: Engine) -> dict[str, Any]:
        spec = engine.spec
        return {
            "prompts": len(self.prompt_lens),
            "prompt_len_p50": _typical(self.prompt_lens),
            "prompt_len_max": max(self.prompt_lens, default=0),
            "decode_steps": len(self.decode_batches),
            "decode_batch": _typical(self.decode_batches),
            "decode_batch_max": max(self.decode_batches, default=0),
            "warm_rows": _typical(self.warm_rows),
            "warm_blocks_per_seq": _typical(self.warm_blocks),
            "warm_blocks_max": max(self.warm_blocks, default=0),
            "max_num_seqs": engine.config.max_num_seqs,
            "block_size": engine.config.block_size,
            "num_layers": spec.num_layers,
            "vocab_size": spec.vocab_size,
            "dtype": str(spec.dtype).removeprefix("torch."),
            "warm_codec": engine.config.warm_codec if engine.warm is not None else None,
            "tiers": engine.tier_stats(),
        }


def _typical(values: list[int]) -> int:
    """The median (the lower one of an even count): a shape that really occurred."""
    return statistics.median_low(values) if values else 0


def replay(engine: Engine, prompts: list[Prompt], max_new_tokens: int) -> Shapes:
    """Run every prompt to completion, greedy and ignoring EOS, recording the live shapes."""
    shapes = Shapes()
    for i, p in enumerate(prompts):
        ids = engine.loaded.tokenizer.encode(p.text)
        limit = p.max_new_tokens or max_new_tokens
        params = SamplingParams(temperature=0.0, max_tokens=limit, ignore_eos=True)
        try:
            engine.validate(ids, params)  # the prompt file is this tool's edge
        except (InvalidRequest, InvalidSamplingParameter) as exc:
            raise ProfilerError(f"prompt file line {p.line}: {exc}") from exc
        engine.add_request(f"profile-{i}", ids, params)
        shapes.prompt_lens.append(len(ids))
    progress, done = hlog.Progress("profiler_replay", len(prompts), unit="requests"), 0
    while engine.has_unfinished():
        shapes.observe(engine)
        done += sum(out.finished for out in engine.step())
        progress.update(done)
    return shapes


def profile_engine(
    engine: Engine, prompts: list[Prompt], max_new_tokens: int, runs: int
) -> TuningProfile:
    """Replay `prompts`, then time the switchable regions at the shapes seen."""
    shapes = replay(engine, prompts, max_new_tokens)
    with torch.inference_mode():  # as the engine runs them: no autograd bookkeeping
        return _profile_regions(engine, shapes, runs)


def _profile_regions(engine: Engine, shapes: Shapes, runs: int) -> TuningProfile:
    summary = shapes.summary(engine)
    log.info("profiler_shapes", **{k: v for k, v in summary.items() if k != "tiers"})
    spec, config = engine.spec, engine.config
    regions = {
        "sample": profile_sample(
            spec.vocab_size, config.num_candidates, engine.device, summary["decode_batch"], runs
        )
    }
    warm = engine.warm
    if warm is None:
        log.info("profiler_no_warm_tier", skipped="attn_warm, kv_codec")
    else:
        rows = summary["warm_rows"] or summary["decode_batch"]
        regions["attn_warm"] = profile_attn_warm(warm, rows, summary["warm_blocks_per_seq"], runs)
        regions["kv_codec"] = profile_kv_codec(warm, runs)
    for name, r in regions.items():
        log.info(
            "profiler_region",
            region=name,
            placement=r.placement,
            cpu_share=r.cpu_share,
            **r.measured,
        )
    cuda = engine.device.type == "cuda"
    commit = git_commit()
    return TuningProfile(
        model=engine.config.model,
        device="cuda" if cuda else "cpu",
        device_name=torch.cuda.get_device_name(engine.device)
        if cuda
        else machine_info()["host_cpu"],
        created=datetime.now(UTC).isoformat(timespec="seconds"),
        commit=None if commit == "unknown" else commit,
        shapes=summary,
        regions=regions,
    )


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="hybridgen-profiler", description=(__doc__ or "").splitlines()[0]
    )
    ap.add_argument("--prompt-file", type=Path, required=True, metavar="FILE", help="JSON lines")
    ap.add_argument("--model", default=None, help="checkpoint folder or preset (config's)")
    ap.add_argument("--config", type=Path, default=None, help="hybridgen_config.yaml")
    ap.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    ap.add_argument("--max-new-tokens", type=int_range(1), default=128, help="unless the line says")
    ap.add_argument("--runs", type=int_range(1), default=5, help="timed runs per figure (best)")
    ap.add_argument("--out", type=Path, default=Path("tuning_profile.json"))
    return ap


def run(args: argparse.Namespace) -> TuningProfile:
    try:
        prompts = load_prompts(args.prompt_file)
    except ValueError as exc:
        raise ProfilerError(f"--prompt-file: {exc}") from exc
    config = load_config(args.config).with_model(args.model)
    # Measure afresh: an existing profile must not decide the placements being measured.
    config = dataclasses.replace(config, profile_path=None)
    engine = Engine(config.engine_config(args.device))
    # Not released on an error: the traceback's frames may still view the Warm pool, which
    # then cannot unmap; the process ends anyway, and a private pool is already unlinked.
    profile = profile_engine(engine, prompts, args.max_new_tokens, args.runs)
    engine.release()
    save_profile(profile, args.out)
    return profile


def report(profile: TuningProfile, out: Path) -> None:
    print(f"\ntuning profile of {profile.model} on {profile.device} ({profile.device_name}):")
    head = ("cpu_ms", "gpu_ms", "pcie_cpu", "pcie_gpu")
    print(f"{'region':10} {'placement':12} " + " ".join(f"{h:>10}" for h in head))
    for name, r in profile.regions.items():
        place = f"split:{r.cpu_share:.3f}" if r.placement == "split" else r.placement
        m = r.measured
        print(
            f"{name:10} {place:12} {m['cpu_ms']:10.3f} {m['gpu_ms']:10.3f} "
            f"{m['pcie_bytes_cpu']:10.0f} {m['pcie_bytes_gpu']:10.0f}"
        )
    print(f"wrote {out}; set profile_path: {out.resolve()} in hybridgen_config.yaml to use it")


def main(argv: list[str] | None = None) -> int:
    """The console script: 0 once the profile is written, 2 (with the reason) when the replay
    cannot run as asked. The profile is the file, not the return value: a console script's
    return value becomes its exit status."""
    args = build_parser().parse_args(argv)
    hlog.configure()
    try:
        profile = run(args)
    except (ConfigError, BudgetTooSmall, ProfilerError, NoWarmRoom) as exc:
        print(f"hybridgen-profiler: {exc}", file=sys.stderr)
        return 2
    report(profile, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
