"""Offline profile of the switchable op-regions: replay a prompt file, time each region on each
device at the live shapes, and write tuning_profile.json (format: hybridgen.tuning_profile).

    hybridgen-profiler --prompt-file prompts.jsonl [--model M] [--config FILE] \\
        [--device auto|cpu|cuda] [--max-new-tokens N] [--out tuning_profile.json]

(or `python -m hybridgen.tools.profiler ...`). The engine is built in this process from the
config, as the GPU daemon builds it. Every prompt of the file (e2e_benchmark's format: JSON
lines {"prompt": ..., "max_new_tokens": optional}) runs greedy, ignoring EOS, with the
scheduler keeping max_num_seqs running as a server would; the replay records the decode batch
sizes, prompt lengths, Warm blocks per decoding sequence and the KV tier figures. Then each
switchable region is timed both ways at the typical shapes (best of --runs after a warm-up,
host time with the device synchronized) and the bytes crossing PCIe per step are counted:

    attn_warm  CPU partial over the Warm blocks vs the device's (WarmTier.device_partial), all
               layers; placed by warm_tier.choose_placement (cpu, gpu, or split with a share)
    sample     the device sampler vs top-K candidates to the host and the CPU's pick
    kv_codec   encode on the device + D2H of the records vs D2H of the raw block + encode on
               the CPU, one block of every layer

attn_warm and kv_codec need a Warm tier (kv_cache.warm_region_mb). Under the daemons the CPU's
sampling pick also costs a ring round trip per token, which is not timed here. On a CPU-only
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

from hybridgen import log as hlog
from hybridgen.benchmarks.e2e_benchmark import Prompt, int_range, load_prompts
from hybridgen.benchmarks.report import git_commit, machine_info
from hybridgen.config import load_config
from hybridgen.cpu_daemon.warm_attention import WarmSpan, warm_decode_attention
from hybridgen.engine_config import ConfigError
from hybridgen.gpu_daemon.engine import Engine, InvalidRequest
from hybridgen.gpu_daemon.memory import BudgetTooSmall
from hybridgen.gpu_daemon.warm_tier import WarmTier, best_of, choose_placement
from hybridgen.sampling.candidates import Candidates, sample_candidates
from hybridgen.sampling.params import SamplingParams
from hybridgen.sampling.sampler import Sampler, SamplingBatch
from hybridgen.tuning_profile import RegionProfile, TuningProfile, save_profile

log = structlog.get_logger()

GREEDY = SamplingParams(temperature=0.0)


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
            engine.add_request(f"profile-{i}", ids, params)
        except InvalidRequest as exc:
            raise ProfilerError(f"prompt file line {p.line}: {exc}") from exc
        shapes.prompt_lens.append(len(ids))
    progress, done = hlog.Progress("profiler_replay", len(prompts), unit="requests"), 0
    while engine.has_unfinished():
        shapes.observe(engine)
        done += sum(out.finished for out in engine.step())
        progress.update(done)
    return shapes


def _randn(*shape: int, dtype: torch.dtype, device: torch.device, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen).to(dtype=dtype, device=device)


def profile_attn_warm(warm: WarmTier, rows: int, blocks: int, runs: int) -> RegionProfile:
    """attn_warm over `rows` decoding sequences of `blocks` Warm blocks each, all layers."""
    spec, bs, device = warm.spec, warm.block_size, warm.device
    rows, blocks = max(1, rows), max(1, blocks)
    held = warm.room(rows * blocks)  # rows share slots when the pool holds fewer
    if held == 0:
        raise ProfilerError("the Warm pool has no free slot to time attn_warm with")
    slots = warm.index.alloc(held)
    kv = _randn(spec.num_layers, bs, spec.num_kv_heads, spec.head_dim, dtype=spec.dtype,
                device=device, seed=1)  # fmt: skip
    for slot in slots:
        warm.pool.store(slot, kv, kv)
    table = [[slots[(r * blocks + j) % held] for j in range(blocks)] for r in range(rows)]
    spans = [WarmSpan(t, 0, bs, blocks * bs) for t in table]
    q = _randn(rows, spec.num_heads, spec.head_dim, dtype=spec.dtype, device=device, seed=2)
    scale = spec.head_dim**-0.5

    def cpu() -> None:
        for layer in range(spec.num_layers):
            out, lse = warm_decode_attention(warm.pool, layer, q, spans, scale)
            out.to(device), lse.to(device)

    def gpu() -> None:
        for layer in range(spec.num_layers):
            warm.device_partial(layer, q, table, scale)

    try:
        cpu_ms, gpu_ms = (best_of(runs, f, device) * 1e3 for f in (cpu, gpu))
    finally:
        warm.pool.free(slots)
    placement, share = choose_placement(cpu_ms, gpu_ms)
    # cpu: q out and the fp32 (out, lse) partial back, per layer; gpu: the records in.
    heads = rows * spec.num_heads
    per_layer = heads * spec.head_dim * (spec.dtype.itemsize + 4) + heads * 4
    measured = {
        "cpu_ms": cpu_ms,
        "gpu_ms": gpu_ms,
        "pcie_bytes_cpu": spec.num_layers * per_layer,
        "pcie_bytes_gpu": rows * blocks * warm.pool.slot_bytes,
        "rows": rows,
        "blocks": blocks,
    }
    return RegionProfile(placement, share if placement == "split" else None, measured)


def profile_sample(engine: Engine, batch: int, runs: int) -> RegionProfile:
    """Greedy picks for [batch, vocab] fp32 logits: the device sampler vs the CPU's pick from
    the top num_candidates logits per row (their D2H included), as model_runner does them."""
    batch, vocab, device = max(1, batch), engine.spec.vocab_size, engine.device
    k = min(engine.config.num_candidates, vocab)
    logits = _randn(batch, vocab, dtype=torch.float32, device=device, seed=3)
    sampler, params = Sampler(), [GREEDY] * batch

    def gpu() -> None:
        sb = SamplingBatch.build(params, [0] * batch, [0] * batch, None, None, vocab, device)
        sampler(logits, sb).token_ids.cpu()

    def cpu() -> None:
        t = torch.tensor([1.0] * batch, device=device)[:, None]  # greedy rows: temperature 1
        vals, ids = logits.topk(k, dim=-1)
        lse = torch.logsumexp(logits, -1, keepdim=True)
        lse_t = torch.logsumexp(logits / t, -1, keepdim=True)
        floats = torch.cat([vals, lse, lse_t], dim=-1).cpu().numpy()
        ids_host = ids.to(torch.int32).cpu().numpy()
        for i in range(batch):
            c = Candidates(ids_host[i], floats[i, :k], float(floats[i, k]), float(floats[i, k + 1]))
            sample_candidates(c, GREEDY, 0, 0)

    cpu_ms, gpu_ms = (best_of(runs, f, device) * 1e3 for f in (cpu, gpu))
    measured = {
        "cpu_ms": cpu_ms,
        "gpu_ms": gpu_ms,
        "pcie_bytes_cpu": batch * (4 + k * 8 + 8),  # temperatures in; k ids, k logits, 2 lse out
        "pcie_bytes_gpu": batch * (6 * 4 + 4 * 8 + 8),  # SamplingBatch in; the token ids out
        "batch": batch,
        "candidates": k,
    }
    return RegionProfile("cpu" if cpu_ms < gpu_ms else "gpu", None, measured)


def profile_kv_codec(warm: WarmTier, runs: int) -> RegionProfile:
    """Encoding one Hot block of every layer for the Warm pool, on either side of PCIe."""
    spec, device, codec = warm.spec, warm.device, warm.pool.codec
    shape = (spec.num_layers, warm.block_size, spec.num_kv_heads, spec.head_dim)
    k = _randn(*shape, dtype=spec.dtype, device=device, seed=4)
    v = _randn(*shape, dtype=spec.dtype, device=device, seed=5)

    def gpu() -> None:
        codec.encode_blocks(k, v).cpu()

    def cpu() -> None:
        codec.encode_blocks(k.cpu(), v.cpu())

    cpu_ms, gpu_ms = (best_of(runs, f, device) * 1e3 for f in (cpu, gpu))
    measured = {
        "cpu_ms": cpu_ms,
        "gpu_ms": gpu_ms,
        "pcie_bytes_cpu": 2 * k.numel() * k.element_size(),
        "pcie_bytes_gpu": warm.pool.slot_bytes,
        "blocks": 1,
    }
    return RegionProfile("cpu" if cpu_ms < gpu_ms else "gpu", None, measured)


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
    regions = {"sample": profile_sample(engine, summary["decode_batch"], runs)}
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


def main(argv: list[str] | None = None) -> TuningProfile:
    args = build_parser().parse_args(argv)
    hlog.configure()
    try:
        profile = run(args)
    except (ConfigError, BudgetTooSmall, ProfilerError) as exc:
        print(f"hybridgen-profiler: {exc}", file=sys.stderr)
        raise SystemExit(2) from exc
    report(profile, args.out)
    return profile


if __name__ == "__main__":
    main()
