"""tuning_profile.json: where the switchable regions run, measured offline by hybridgen-profiler.

The file (version 1)::

    {
      "version": 1,
      "model": "/models/llama3-8b",        the config's model.name_or_path when profiled
      "device": "cuda",                     cuda, or cpu (both code paths timed on the CPU)
      "device_name": "NVIDIA A10",
      "created": "2025-01-01T12:00:00+00:00",
      "commit": "4f2c...",                  null when unknown
      "shapes": {"decode_batch": 4, ...},   the live shapes the regions were timed at
      "regions": {
        "attn_warm": {"placement": "split", "cpu_share": 0.25,
                      "measured": {"cpu_ms": 1.9, "gpu_ms": 0.6, "pcie_bytes_cpu": 4096, ...}},
        "sample":    {"placement": "gpu", "measured": {...}},
        "kv_codec":  {"placement": "cpu", "measured": {...}}
      }
    }

`cpu_share` (the CPU's share of each sequence's Warm blocks) is given with placement split
and only then. A region the file leaves out is placed as without a profile. Precedence, from
placement/op_regions.py: the config's pinned `placements` > this profile > measured at start >
default; `resolve_placements` applies the first two, the engine the rest.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog

from hybridgen.config.engine import ConfigError
from hybridgen.placement.op_regions import SWITCHABLE

log = structlog.get_logger()

PROFILE_VERSION = 1
"""The layout this HybridGen reads and writes."""
PLACEMENTS: Mapping[str, tuple[str, ...]] = {
    "attn_warm": ("cpu", "gpu", "split"),
    "kv_codec": ("cpu", "gpu"),
    "sample": ("cpu", "gpu"),
}
"""Allowed placements of each profiled region (the switchable ones, op_regions.SWITCHABLE)."""
assert set(PLACEMENTS) == set(SWITCHABLE)
_REQUIRED = ("version", "model", "device", "created", "regions")
_OPTIONAL = ("device_name", "commit", "shapes")


@dataclass(frozen=True)
class RegionProfile:
    """One region's placement and the figures behind it."""

    placement: str
    """cpu, gpu or (attn_warm only) split."""
    cpu_share: float | None = None
    """With placement split: the CPU's share (0..1) of each sequence's Warm blocks."""
    measured: Mapping[str, float] = field(default_factory=dict)
    """cpu_ms / gpu_ms of the same work, pcie_bytes_cpu / pcie_bytes_gpu per step, and the
    shape it was timed at."""


@dataclass(frozen=True)
class TuningProfile:
    """A parsed tuning_profile.json."""

    model: str
    """model.name_or_path it was profiled with."""
    device: str
    """cuda, or cpu: a CPU-only machine, where both code paths of a region ran on the CPU."""
    regions: Mapping[str, RegionProfile]
    """Placement per region; regions left out are placed as without a profile."""
    created: str = ""
    """ISO 8601 time it was written."""
    commit: str | None = None
    """HybridGen commit that wrote it, when known."""
    device_name: str = ""
    """The GPU's (or the CPU's) name."""
    shapes: Mapping[str, Any] = field(default_factory=dict)
    """The live shapes of the replay: decode batch, prompt lengths, Warm blocks, tier stats."""
    version: int = PROFILE_VERSION
    """File layout version."""

    def as_dict(self) -> dict[str, Any]:
        regions: dict[str, Any] = {}
        for name, r in self.regions.items():
            row: dict[str, Any] = {"placement": r.placement}
            if r.cpu_share is not None:
                row["cpu_share"] = r.cpu_share
            regions[name] = {**row, "measured": dict(r.measured)}
        return {
            "version": self.version,
            "model": self.model,
            "device": self.device,
            "device_name": self.device_name,
            "created": self.created,
            "commit": self.commit,
            "shapes": dict(self.shapes),
            "regions": regions,
        }


def save_profile(profile: TuningProfile, path: str | Path) -> None:
    """Write `profile` as JSON, atomically (a server starting meanwhile never reads half)."""
    path = Path(path)
    parse_profile(profile.as_dict(), str(path))  # never write what load_profile refuses
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(json.dumps(profile.as_dict(), indent=2) + "\n", encoding="utf-8")
    tmp.replace(path)


def load_profile(path: str | Path) -> TuningProfile:
    """Read and check a tuning_profile.json; errors name the file and the key inside it."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read tuning profile {path}: {exc}") from exc
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path}:{exc.lineno}: invalid JSON: {exc.msg}") from exc
    return parse_profile(data, str(path))


def parse_profile(data: object, where: str = "tuning_profile.json") -> TuningProfile:
    """Check a parsed profile document; `where` prefixes every error."""
    top = _mapping(data, "the profile", where)
    _keys(top, "", _REQUIRED, _OPTIONAL, where)
    version = top["version"]
    if type(version) is not int or version != PROFILE_VERSION:
        raise ConfigError(
            f"{where}: version={version!r} is out of range: allowed {PROFILE_VERSION} "
            "(profile again with this HybridGen's hybridgen-profiler)"
        )
    device = top["device"]
    if device not in ("cpu", "cuda"):
        raise ConfigError(f"{where}: device={device!r} is out of range: allowed cpu or cuda")
    commit = top.get("commit")
    if commit is not None:
        commit = _string(commit, "commit", where)
    regions = _mapping(top["regions"], "regions", where)
    return TuningProfile(
        model=_string(top["model"], "model", where),
        device=device,
        regions={name: _region(name, value, where) for name, value in regions.items()},
        created=_string(top["created"], "created", where),
        commit=commit,
        device_name=_string(top.get("device_name", ""), "device_name", where, empty=True),
        shapes=dict(_mapping(top.get("shapes", {}), "shapes", where)),
    )


def _region(name: str, value: object, where: str) -> RegionProfile:
    if name not in PLACEMENTS:
        raise ConfigError(
            f"{where}: unknown region 'regions.{name}'; allowed {', '.join(PLACEMENTS)}"
        )
    key = f"regions.{name}"
    row = _mapping(value, key, where)
    _keys(row, f"{key}.", ("placement",), ("cpu_share", "measured"), where)
    placement, allowed = row["placement"], PLACEMENTS[name]
    if placement not in allowed:
        raise ConfigError(
            f"{where}: {key}.placement={placement!r} is out of range: "
            f"allowed {', '.join(allowed[:-1])} or {allowed[-1]}"
        )
    share = row.get("cpu_share")
    if placement == "split" and share is None:
        raise ConfigError(f"{where}: {key}.cpu_share is missing: required with placement split")
    if placement != "split" and share is not None:
        raise ConfigError(
            f"{where}: {key}.cpu_share={share!r} is out of range: allowed only with placement split"
        )
    if share is not None:
        share = _number(share, f"{key}.cpu_share", where)
        if not 0.0 <= share <= 1.0:
            raise ConfigError(f"{where}: {key}.cpu_share={share!r} is out of range: allowed 0..1")
    measured = _mapping(row.get("measured", {}), f"{key}.measured", where)
    figures = {str(k): _number(v, f"{key}.measured.{k}", where) for k, v in measured.items()}
    return RegionProfile(placement, share, figures)


def _mapping(value: object, key: str, where: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise ConfigError(f"{where}: {key} must be an object of keys, got {value!r}")
    return value


def _keys(
    data: Mapping[str, Any],
    prefix: str,
    required: tuple[str, ...],
    optional: tuple[str, ...],
    where: str,
) -> None:
    known = (*required, *optional)
    for key in data:
        if key not in known:
            raise ConfigError(
                f"{where}: unknown key '{prefix}{key}'; known keys: {', '.join(known)}"
            )
    for key in required:
        if key not in data:
            raise ConfigError(f"{where}: {prefix}{key} is missing")


def _string(value: object, key: str, where: str, empty: bool = False) -> str:
    if not isinstance(value, str) or not (empty or value.strip()):
        raise ConfigError(f"{where}: {key}={value!r} has the wrong type: expected a string")
    return value


def _number(value: object, key: str, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError(f"{where}: {key}={value!r} has the wrong type: expected a number")
    if not math.isfinite(value):
        raise ConfigError(f"{where}: {key}={value!r} is out of range: allowed a finite number")
    return float(value)


@dataclass(frozen=True)
class Resolved:
    """The switchable regions' placements from the pinned ones and the profile; None: neither
    says, the caller's default (or the engine's measurement) applies."""

    attn_warm: str | None = None
    warm_split: float | None = None
    """attn_warm's CPU share, when placed split and the profile measured it."""
    sample: str | None = None
    kv_codec: str | None = None
    profiled: tuple[str, ...] = ()
    """Regions the profile placed (not pinned)."""
    measured: tuple[tuple[str, str, float], ...] = ()
    """(region, key, value): the profile's figures behind what it decided."""


def resolve_placements(pinned: Mapping[str, str | None], profile: TuningProfile | None) -> Resolved:
    """Pinned over profile, per region. attn_warm pinned split takes its CPU share from the
    profile too (its cpu_share, or the share that makes both sides finish together), so that
    no start-up probe runs."""
    regions = profile.regions if profile is not None else {}
    chosen: dict[str, str | None] = {}
    profiled: list[str] = []
    for name in PLACEMENTS:
        row = regions.get(name)
        if pinned.get(name) is None and row is not None:
            profiled.append(name)
        chosen[name] = pinned.get(name) or (row.placement if row is not None else None)
    split, warm, figures = None, regions.get("attn_warm"), list(profiled)
    if chosen["attn_warm"] == "split" and warm is not None:
        split = warm.cpu_share if warm.placement == "split" else _balanced_share(warm.measured)
        if split is not None and "attn_warm" not in figures:
            figures.append("attn_warm")  # pinned split, its share from the profile
    return Resolved(
        attn_warm=chosen["attn_warm"],
        warm_split=split,
        sample=chosen["sample"],
        kv_codec=chosen["kv_codec"],
        profiled=tuple(profiled),
        measured=tuple(
            (name, key, value) for name in figures for key, value in regions[name].measured.items()
        ),
    )


def _balanced_share(measured: Mapping[str, float]) -> float | None:
    """The CPU share at which both sides finish together (warm_tier's rule), from the times."""
    cpu, gpu = measured.get("cpu_ms"), measured.get("gpu_ms")
    if cpu is None or gpu is None or cpu + gpu <= 0:
        return None
    return gpu / (cpu + gpu)


def warn_mismatch(profile: TuningProfile, model: str, device: str) -> None:
    """Log when the profile was measured for another model or kind of device: its placements
    still apply (a path may differ between hosts), but they may no longer be the fastest."""
    kind = "cuda" if device.startswith("cuda") else "cpu"  # auto left unresolved: no CUDA
    if profile.model != model:
        log.warning("tuning_profile_other_model", profiled=profile.model, serving=model)
    if profile.device != kind:
        log.warning("tuning_profile_other_device", profiled=profile.device, serving=kind)
