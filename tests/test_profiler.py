"""hybridgen-profiler and tuning_profile.json: the profiler replays a prompt file and writes a
profile of every switchable region; a config's profile_path then places the regions as the
file says (pinned > profile > measured > default) with no start-up probe, pure_gpu ignores
it, bad files are errors naming the key, and greedy tokens do not change."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from structlog.testing import capture_logs

from hybridgen.config.engine import EngineConfig
from hybridgen.config.file import ConfigError, load_config
from hybridgen.engine import engine as engine_module
from hybridgen.engine.engine import Engine
from hybridgen.engine.info import engine_regions
from hybridgen.placement.region_timing import choose_placement
from hybridgen.placement.tuning_profile import (
    RegionProfile,
    TuningProfile,
    load_profile,
    resolve_placements,
    save_profile,
)
from hybridgen.sampling.params import SamplingParams
from hybridgen.tools import profiler
from tests.hf_reference import sample_prompts

PROFILER = str(Path(sys.executable).with_name("hybridgen-profiler"))
"""The console script pip installed beside this interpreter."""
REGIONS = {"attn_warm", "kv_codec", "sample"}
FIGURES = {"cpu_ms", "gpu_ms", "pcie_bytes_cpu", "pcie_bytes_gpu"}
PROMPTS = [  # one line takes its own limit, the others --max-new-tokens
    {"prompt": "The quick brown fox jumps over the lazy dog. " * 6},
    {"prompt": "Attention looks back over every earlier position. " * 5},
    {"prompt": "Hello", "max_new_tokens": 8},
]


def _config(folder: Path, model: Path, **top: Any) -> Path:
    """A config with a Hot pool of 7 blocks (8 tokens each) and a 2 MiB lossless Warm tier,
    so the prompts' KV lives mostly in Warm while they decode."""
    data: dict[str, Any] = {
        "kv_cache": {
            "hot_region_mb": 0.03,
            "warm_region_mb": 2,
            "warm_codec": "lossless",
            "block_size": 8,
        },
        "model": {
            "name_or_path": str(model),
            "max_model_len": 256,
            "max_num_seqs": 2,
            "max_num_batched_tokens": 32,
        },
        **top,
    }
    path = folder / "hybridgen_config.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def _prompt_file(folder: Path) -> Path:
    path = folder / "prompts.jsonl"
    path.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    return path


def _hand_profile(model: Path, **regions: RegionProfile) -> TuningProfile:
    figures = {"cpu_ms": 1.0, "gpu_ms": 3.0, "pcie_bytes_cpu": 10.0, "pcie_bytes_gpu": 99.0}
    rows = {
        "sample": RegionProfile("cpu", None, figures),
        "kv_codec": RegionProfile("cpu", None, figures),
        "attn_warm": RegionProfile("split", 0.25, figures),
        **regions,
    }
    return TuningProfile(str(model), "cpu", rows, created="2025-01-01T00:00:00+00:00")


@pytest.mark.slow
def test_profiler_measures_every_region_and_round_trips(  # type: ignore[no-untyped-def]
    checkpoint, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HYBRIDGEN_COMMIT", "c0ffee")  # no git here: the commit is known
    # main() would configure logging onto this test's captured stderr; keep pytest's.
    monkeypatch.setattr(profiler.hlog, "configure", lambda: None)
    model, out = checkpoint("llama3"), tmp_path / "tuning_profile.json"
    args = ["--prompt-file", str(_prompt_file(tmp_path)), "--device", "cpu", "--out", str(out)]
    config = _config(tmp_path, model)
    with capture_logs() as logs:
        status = profiler.main(
            [*args, "--config", str(config), "--max-new-tokens", "24", "--runs", "2"]
        )
    assert status == 0
    profile = load_profile(out)
    assert (profile.model, profile.device, profile.commit) == (str(model), "cpu", "c0ffee")
    assert set(profile.regions) == REGIONS
    for region in profile.regions.values():
        assert set(region.measured) >= FIGURES
        assert region.measured["cpu_ms"] > 0 and region.measured["gpu_ms"] > 0
    warm = profile.regions["attn_warm"]
    mode, share = choose_placement(warm.measured["cpu_ms"], warm.measured["gpu_ms"])
    assert (warm.placement, warm.cpu_share) == (mode, share if mode == "split" else None)
    for name in ("sample", "kv_codec"):
        m = profile.regions[name].measured
        assert profile.regions[name].placement == ("cpu" if m["cpu_ms"] < m["gpu_ms"] else "gpu")
    shapes = profile.shapes
    assert shapes["prompts"] == 3 and shapes["decode_batch"] == 2
    assert shapes["prompt_len_max"] > shapes["prompt_len_p50"] > 100
    assert shapes["warm_blocks_per_seq"] > 0 and shapes["tiers"]["hot_hit_rate"] < 0.5
    assert warm.measured["blocks"] == shapes["warm_blocks_per_seq"]
    progress = [(e["done"], e["total"]) for e in logs if e["event"] == "profiler_replay"]
    assert progress[-1] == (3, 3)

    # The console script, as a user runs it: the same file, from a fresh process, exit 0.
    out.unlink()
    env = {**os.environ, "HYBRIDGEN_COMMIT": "c0ffee"}
    cmd = [PROFILER, *args, "--config", str(config)]
    done = subprocess.run(
        [*cmd, "--max-new-tokens", "8", "--runs", "1"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "TuningProfile(" not in done.stderr + done.stdout
    assert set(load_profile(out).regions) == REGIONS
    assert f"wrote {out}" in done.stdout
    assert "profiler_replay" in done.stderr and "done=3" in done.stderr


def test_profiler_console_script_fails_with_the_reason(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere.jsonl"
    done = subprocess.run(
        [PROFILER, "--prompt-file", str(missing), "--device", "cpu"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1].startswith("hybridgen-profiler: --prompt-file")
    assert str(missing) in done.stderr


@pytest.mark.slow
def test_profile_places_the_regions_without_a_probe(  # type: ignore[no-untyped-def]
    checkpoint, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = checkpoint("llama3")
    probes: list[EngineConfig] = []
    real_probe = engine_module.place_attn_warm

    def probe(warm, config: EngineConfig, device):  # type: ignore[no-untyped-def]
        if config.attn_warm == "auto" or (config.attn_warm, config.warm_split) == ("split", None):
            probes.append(config)  # a placement the start-up timing decides
        return real_probe(warm, config, device)

    monkeypatch.setattr(engine_module, "place_attn_warm", probe)
    save_profile(_hand_profile(model), tmp_path / "tuning_profile.json")
    (tmp_path / "p").mkdir()
    plain = load_config(_config(tmp_path / "p", model))
    config = load_config(_config(tmp_path, model, profile_path="tuning_profile.json"))
    ec = config.engine_config("cpu")
    assert (ec.sample_placement, ec.kv_codec_placement) == ("cpu", "cpu")
    assert (ec.attn_warm, ec.warm_split) == ("split", 0.25)
    assert set(ec.profiled_regions) == REGIONS and ec.pinned_regions == ()

    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    prompts: list[str | list[int]] = list(sample_prompts(model, 2, [150, 97]))
    reference = Engine(plain.engine_config("cpu"))
    assert len(probes) == 1  # without a profile, attn_warm auto is probed at start
    expected = [c.token_ids for c in reference.generate(prompts, params)]
    reference.release()

    engine = Engine(ec)
    assert len(probes) == 1  # no probe with the profile
    warm = engine.warm
    assert warm is not None and "attn_warm" not in engine.measured
    assert engine.config.sample_placement == "cpu" and warm.codec_on == "cpu"
    assert (warm.mode, warm.split) == ("split", 0.25)
    rows = {r.name: r for r in engine_regions(engine)}
    assert {n: (rows[n].placement, rows[n].source) for n in REGIONS} == {
        "attn_warm": ("split:0.250", "profile"),
        "kv_codec": ("cpu", "profile"),
        "sample": ("cpu", "profile"),
    }
    assert rows["sample"].measured["gpu_ms"] == 3.0
    assert [c.token_ids for c in engine.generate(prompts, params)] == expected
    assert warm.stats.warm_keys > 0 and warm.stats.cpu.calls > 0  # both tiers were attended
    engine.release()


def test_pinned_placements_win_over_the_profile(checkpoint, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    model = checkpoint("llama3")
    save_profile(_hand_profile(model), tmp_path / "tuning_profile.json")
    pins = {"sample": "gpu", "attn_warm": "cpu"}
    config = load_config(
        _config(tmp_path, model, profile_path="tuning_profile.json", placements=pins)
    )
    ec = config.engine_config("cpu")
    assert (ec.sample_placement, ec.attn_warm, ec.warm_split) == ("gpu", "cpu", None)
    assert ec.kv_codec_placement == "cpu" and ec.profiled_regions == ("kv_codec",)
    engine = Engine(ec)
    rows = {r.name: r for r in engine_regions(engine)}
    assert (rows["sample"].placement, rows["sample"].source) == ("gpu", "pinned")
    assert (rows["attn_warm"].placement, rows["attn_warm"].source) == ("cpu", "pinned")
    assert (rows["kv_codec"].placement, rows["kv_codec"].source) == ("cpu", "profile")
    engine.release()


def test_pinned_split_takes_its_share_from_the_profile() -> None:
    model, pinned = Path("/models/m"), {"attn_warm": "split"}
    split = resolve_placements(pinned, _hand_profile(model))
    assert (split.attn_warm, split.warm_split) == ("split", 0.25)
    assert set(split.profiled) == {"sample", "kv_codec"}  # attn_warm: pinned, share profiled
    gpu = RegionProfile("gpu", None, {"cpu_ms": 3.0, "gpu_ms": 1.0})
    balanced = resolve_placements(pinned, _hand_profile(model, attn_warm=gpu))
    assert balanced.warm_split == pytest.approx(0.25)  # both sides finish together
    assert ("attn_warm", "gpu_ms", 1.0) in balanced.measured
    none = resolve_placements({}, None)
    assert (none.attn_warm, none.sample, none.kv_codec, none.profiled) == (None, None, None, ())


def test_pure_gpu_ignores_the_profile(checkpoint, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    model = checkpoint("llama3")
    (tmp_path / "tuning_profile.json").write_text("not even JSON")  # never read
    path = _config(tmp_path, model, profile_path="tuning_profile.json", mode="pure_gpu")
    data = yaml.safe_load(path.read_text())
    data["kv_cache"]["warm_region_mb"] = 0
    path.write_text(yaml.safe_dump(data))
    ec = load_config(path).engine_config("cpu")
    assert (ec.sample_placement, ec.kv_codec_placement, ec.attn_warm) == ("gpu", "gpu", "gpu")
    assert ec.profiled_regions == () and ec.profile_measured == ()


def test_a_missing_profile_is_warned_about_and_skipped(checkpoint, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    config = load_config(_config(tmp_path, checkpoint("llama3"), profile_path="later.json"))
    with capture_logs() as logs:
        ec = config.engine_config("cpu")
    assert (ec.attn_warm, ec.sample_placement, ec.profiled_regions) == ("auto", "gpu", ())
    assert [e["profile_path"] for e in logs if e["event"] == "tuning_profile_missing"] == [
        str(tmp_path / "later.json")
    ]


def _good() -> dict[str, Any]:
    return _hand_profile(Path("/models/m")).as_dict()


def _set(data: dict[str, Any], dotted: str, value: object) -> dict[str, Any]:
    *parents, leaf = dotted.split(".")
    node = data
    for key in parents:
        node = node[key]
    if value is _DROP:
        del node[leaf]
    else:
        node[leaf] = value
    return data


_DROP = object()


@pytest.mark.parametrize(
    ("dotted", "value", "message"),
    [
        (
            "regions.sample.placement",
            "tpu",
            "regions.sample.placement='tpu' is out of range: allowed cpu or gpu",
        ),
        (
            "regions.attn_warm.placement",
            "gpus",
            "regions.attn_warm.placement='gpus' is out of range: allowed cpu, gpu or split",
        ),
        ("regions.rope", {"placement": "cpu"}, "unknown region 'regions.rope'"),
        (
            "regions.attn_warm.cpu_share",
            1.5,
            "regions.attn_warm.cpu_share=1.5 is out of range: allowed 0..1",
        ),
        ("regions.attn_warm.cpu_share", _DROP, "regions.attn_warm.cpu_share is missing"),
        (
            "regions.sample.cpu_share",
            0.5,
            "regions.sample.cpu_share=0.5 is out of range: allowed only with placement split",
        ),
        ("regions.kv_codec.measured.cpu_ms", "fast", "regions.kv_codec.measured.cpu_ms='fast'"),
        ("regions.sample.speed", 1, "unknown key 'regions.sample.speed'"),
        ("version", 2, "version=2 is out of range: allowed 1"),
        ("device", "tpu", "device='tpu' is out of range: allowed cpu or cuda"),
        ("tuned", True, "unknown key 'tuned'"),
        ("regions", _DROP, "regions is missing"),
        ("regions", [], "regions must be an object"),
    ],
)
def test_bad_profile_names_the_key(
    tmp_path: Path, dotted: str, value: object, message: str
) -> None:
    path = tmp_path / "tuning_profile.json"
    path.write_text(json.dumps(_set(_good(), dotted, value)))
    with pytest.raises(ConfigError) as err:
        load_profile(path)
    assert str(err.value).startswith(f"{path}: ")
    assert message in str(err.value)


def test_bad_profile_stops_the_engine_config(checkpoint, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "tuning_profile.json"
    path.write_text('{"version": 1,\n  "model": oops}')
    with pytest.raises(ConfigError, match=rf"^{path}:2: invalid JSON"):
        load_profile(path)
    path.write_text(json.dumps(_set(_good(), "regions.sample.placement", "tpu")))
    config = load_config(_config(tmp_path, checkpoint("llama3"), profile_path=path.name))
    with pytest.raises(ConfigError, match=r"regions\.sample\.placement='tpu' is out of range"):
        config.engine_config("cpu")
