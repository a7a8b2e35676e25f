"""hybridgen_config.yaml: every section parses, every mistake names its dotted key."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import yaml

from hybridgen.config.engine import ConfigError as EngineConfigError
from hybridgen.config.engine import EngineConfig
from hybridgen.config.file import (
    ConfigError,
    HybridGenConfig,
    load_config,
    parse_config,
)
from hybridgen.models.default_model import DEFAULT_MODEL

EXAMPLE = Path(__file__).resolve().parents[1] / "hybridgen_config.example.yaml"

FULL: dict[str, Any] = {
    "device_topology": {
        "gpu": {
            "id": 1,
            "memory_mb": 24576,
            "bandwidth_gbps": 600,
            "tensor_parallel": 1,
            "ids": None,
        },
        "cpu": {
            "cores": "0-15",
            "gpu_daemon_cores": 2,
            "memory_mb": 128000,
            "bandwidth_gbps": 204.8,
        },
    },
    "kv_cache": {
        "hot_region_mb": 4096,
        "warm_region_mb": 8192,
        "cold_threshold_ms": 150,
        "hot_turn_tokens": 64,
        "spill_policy": "never",
        "warm_draft_tokens": 8,
        "hot_codec": "native",
        "warm_codec": "int4",
        "block_size": 32,
        "prefix_reuse": False,
    },
    "offload_threshold": {"softmax": 12000, "layernorm": 800.5, "rotary_emb": 5000},
    "dynamic_tuning": {"enable": False, "warmup_steps": 8, "update_interval_ms": 250},
    "profile_path": "/var/lib/hybridgen/tuning_profile.json",
    "placements": {"attn_warm": "split", "sample": "cpu", "rope": "gpu"},
    "cold_weights": {"expert_cache_slots": 6, "cpu_max_tokens": 2, "expert_format": "native"},
    "weights": {"format": "int4", "gpu_layers": 20, "host_layer_compute": "stream"},
    "model": {
        "name_or_path": "llama3-8b",
        "dtype": "bfloat16",
        "max_model_len": 8192,
        "max_num_seqs": 8,
        "max_num_batched_tokens": 512,
        "step_latency_ms": 40.0,
        "seed": 7,
    },
    "server": {
        "host": "0.0.0.0",
        "port": 8000,
        "metrics_port": 0,
        "http_port": 8080,
        "instance": "a10-test_1",
        "max_queue": 16,
        "max_message_mb": 64,
        "keepalive_s": 10,
        "request_timeout_s": 0,
        "runtime_dir": "/run/hg",
        "metrics_host": "0.0.0.0",
        "max_streams_per_connection": 8,
        "tls": {
            "cert_file": "/etc/hg/cert.pem",
            "key_file": "/etc/hg/key.pem",
            "client_ca_file": "/etc/hg/ca.pem",
        },
        "api_key_file": "/etc/hg/api_keys",
        "reflection": False,
        "cors_origins": ["http://localhost:3000"],
    },
    "mode": "hybrid",
}


def _dotted_fields(cls: Any, prefix: str = "") -> list[str]:
    """Every leaf key of the schema, dotted."""
    keys = []
    for f in dataclasses.fields(cls):
        default = getattr(cls(), f.name)
        if dataclasses.is_dataclass(default):
            keys += _dotted_fields(type(default), f"{prefix}{f.name}.")
        else:
            keys.append(f"{prefix}{f.name}")
    return keys


def _dotted_data(data: dict[str, Any], prefix: str = "") -> list[str]:
    keys = []
    for key, value in data.items():
        if isinstance(value, dict):
            keys += _dotted_data(value, f"{prefix}{key}.")
        else:
            keys.append(f"{prefix}{key}")
    return keys


def _with(dotted: str, value: object) -> dict[str, Any]:
    """A config document setting only `dotted` to `value`."""
    *parents, leaf = dotted.split(".")
    data: dict[str, Any] = {leaf: value}
    for parent in reversed(parents):
        data = {parent: data}
    return data


def test_empty_and_missing_give_defaults(tmp_path: Path) -> None:
    empty = tmp_path / "empty.yaml"
    empty.write_text("# nothing set\n")
    assert load_config(empty) == load_config(None) == parse_config({}) == HybridGenConfig()
    assert parse_config({"kv_cache": None}) == HybridGenConfig()


def test_every_section_parses() -> None:
    config = parse_config(FULL)
    assert set(_dotted_data(FULL)) == set(_dotted_fields(HybridGenConfig)) - {
        # left out of FULL on purpose, to check their defaults survive a partial section
        "placements.norm",
        "placements.softmax",
        "placements.moe_experts",
        "placements.moe_gate",
        "placements.kv_codec",
    }
    topo = config.device_topology
    assert (topo.gpu.id, topo.gpu.memory_mb, topo.gpu.bandwidth_gbps) == (1, 24576, 600.0)
    assert (topo.gpu.tensor_parallel, topo.gpu.device_ids) == (1, (1,))
    assert isinstance(topo.gpu.bandwidth_gbps, float)
    assert topo.cpu.cores == tuple(range(16)) and topo.cpu.gpu_daemon_cores == 2
    assert (topo.cpu.memory_mb, topo.cpu.bandwidth_gbps) == (128000, 204.8)
    kv = config.kv_cache
    assert (kv.hot_region_mb, kv.warm_region_mb, kv.cold_threshold_ms) == (4096, 8192, 150)
    assert kv.hot_turn_tokens == 64 and kv.warm_draft_tokens == 8
    assert kv.spill_policy == "never"
    assert (kv.hot_codec, kv.warm_codec, kv.block_size, kv.prefix_reuse) == (
        "native",
        "int4",
        32,
        False,
    )
    off = config.offload_threshold
    assert (off.softmax, off.layernorm, off.rotary_emb) == (12000.0, 800.5, 5000.0)
    assert config.dynamic_tuning == type(config.dynamic_tuning)(False, 8, 250)
    assert config.profile_path == "/var/lib/hybridgen/tuning_profile.json"
    p = config.placements
    assert (p.attn_warm, p.sample, p.rope, p.norm, p.moe_experts) == (
        "split",
        "cpu",
        "gpu",
        None,
        None,
    )
    assert dataclasses.asdict(config.model) == FULL["model"]
    server = dataclasses.asdict(config.server)
    server["cors_origins"] = list(server["cors_origins"])  # a tuple, as the YAML list
    assert server == FULL["server"]
    assert isinstance(config.server.keepalive_s, float)
    assert config.mode == "hybrid"
    assert parse_config({"mode": "pure_gpu"}).mode == "pure_gpu"


def test_config_is_frozen() -> None:
    config = HybridGenConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.kv_cache.block_size = 32  # type: ignore[misc]


@pytest.mark.parametrize(
    "dotted",
    [
        "colour",
        "device_topology.tpu",
        "device_topology.gpu.memory",
        "device_topology.cpu.threads",
        "kv_cache.hot_mb",
        "offload_threshold.gelu",
        "dynamic_tuning.enabled",
        "placements.qkv_proj",
        "model.name",
        "server.address",
    ],
)
def test_unknown_key_names_dotted_key(dotted: str) -> None:
    with pytest.raises(ConfigError, match=rf"unknown key '{dotted}'.*known keys: "):
        parse_config(_with(dotted, 1))


def test_unknown_key_suggests_the_close_one() -> None:
    with pytest.raises(ConfigError) as err:
        parse_config(_with("kv_cache.hot_mb", 1))
    assert "did you mean 'hot_region_mb'" in str(err.value)
    assert "warm_region_mb" in str(err.value)


@pytest.mark.parametrize(
    ("dotted", "value", "allowed"),
    [
        ("device_topology.gpu.id", -1, ">= 0"),
        ("device_topology.gpu.memory_mb", 10, ">= 64"),
        ("device_topology.gpu.bandwidth_gbps", 0, "> 0"),
        ("device_topology.cpu.memory_mb", 0, ">= 64"),
        ("device_topology.cpu.bandwidth_gbps", -5.0, "> 0"),
        ("kv_cache.hot_region_mb", -3, "> 0"),
        ("kv_cache.warm_region_mb", -1, ">= 0"),
        ("kv_cache.cold_threshold_ms", 0, ">= 1"),
        ("kv_cache.hot_codec", "fp8", "one of native, int8, int4"),
        ("kv_cache.warm_codec", "zstd", "one of lossless, lz4, int8, int4"),
        ("kv_cache.block_size", 17, "one of 8, 16, 32, 64, 128"),
        ("offload_threshold.softmax", -1, ">= 0"),
        ("offload_threshold.layernorm", -0.5, ">= 0"),
        ("offload_threshold.rotary_emb", -1, ">= 0"),
        ("dynamic_tuning.warmup_steps", -1, ">= 0"),
        ("dynamic_tuning.update_interval_ms", 0, ">= 1"),
        ("profile_path", "  ", "a non-empty string"),
        ("placements.attn_warm", "tpu", "one of cpu, gpu, split or null"),
        ("placements.sample", "split", "one of cpu, gpu or null"),
        ("model.name_or_path", "", "a non-empty string"),
        ("model.dtype", "fp8", "one of auto, float32, bfloat16, float16"),
        ("model.max_model_len", 8, ">= 16"),
        ("model.max_num_seqs", 0, "1..4096"),
        ("model.max_num_seqs", 5000, "1..4096"),
        ("model.max_num_batched_tokens", 32, ">= model.max_num_seqs (64)"),
        ("model.step_latency_ms", -1, "0.0..10000.0"),
        ("model.seed", -1, ">= 0"),
        ("server.port", 0, "1..65535"),
        ("server.port", 70000, "1..65535"),
        ("server.metrics_port", 50051, "a port other than server.port"),
        ("server.http_port", 50051, "0 or a port other than server.port and server.metrics_port"),
        ("server.http_port", 9400, "0 or a port other than server.port and server.metrics_port"),
        ("server.http_port", 70000, "0..65535"),
        ("server.instance", "a/b", "1-32 of [A-Za-z0-9_-]"),
        ("server.instance", "x" * 33, "1-32 of [A-Za-z0-9_-]"),
        ("server.max_queue", 0, ">= 1"),
        ("server.max_message_mb", 4096, "1..2047"),
        ("server.keepalive_s", 0, "> 0"),
        ("server.request_timeout_s", -1, ">= 0"),
        ("server.max_streams_per_connection", 0, "1..1000000"),
        ("server.metrics_host", "", "a non-empty string"),
        ("server.api_key_file", " ", "a non-empty string"),
        ("server.tls.cert_file", "", "a non-empty string"),
        ("server.runtime_dir", "run/hybridgen", "an absolute path"),
        ("mode", "pure_cpu", "one of hybrid, pure_gpu"),
    ],
)
def test_out_of_range_names_dotted_key(dotted: str, value: object, allowed: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_config(_with(dotted, value))
    assert str(err.value) == f"{dotted}={value!r} is out of range: allowed {allowed}"


@pytest.mark.parametrize(
    ("dotted", "value", "expected"),
    [
        ("device_topology.gpu.id", "0", "an integer"),
        ("device_topology.gpu.memory_mb", 24576.0, "an integer or null"),
        ("kv_cache.hot_region_mb", True, "a number or null"),
        ("kv_cache.cold_threshold_ms", None, "an integer"),
        ("offload_threshold.softmax", "high", "a number"),
        ("dynamic_tuning.enable", "yes please", "true or false"),
        ("dynamic_tuning.enable", 1, "true or false"),
        ("model.name_or_path", 8, "a string"),
        ("server.port", True, "an integer"),
        ("server.host", None, "a string"),
    ],
)
def test_wrong_type_names_dotted_key(dotted: str, value: object, expected: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_config(_with(dotted, value))
    assert str(err.value) == f"{dotted}={value!r} has the wrong type: expected {expected}"


@pytest.mark.parametrize("section", ["kv_cache", "device_topology.gpu", "placements", "model"])
def test_section_must_be_a_mapping(section: str) -> None:
    with pytest.raises(ConfigError, match=rf"^{section} must be a mapping"):
        parse_config(_with(section, [1, 2]))


def test_top_level_must_be_a_mapping(tmp_path: Path) -> None:
    path = tmp_path / "list.yaml"
    path.write_text("- kv_cache\n")
    with pytest.raises(ConfigError, match="the config must be a mapping"):
        load_config(path)


def test_cross_checks() -> None:
    with pytest.raises(ConfigError, match=r"^kv_cache\.hot_region_mb=8192 .*<= device_topology"):
        parse_config(
            {
                "device_topology": {"gpu": {"memory_mb": 4096}},
                **_with("kv_cache.hot_region_mb", 8192),
            }
        )
    with pytest.raises(ConfigError, match=r"^placements\.sample='cpu' .*mode=pure_gpu"):
        parse_config({"mode": "pure_gpu", "placements": {"sample": "cpu"}})
    assert parse_config({"mode": "pure_gpu", "placements": {"sample": "gpu"}})


@pytest.mark.parametrize(
    ("text", "line", "problem"),
    [
        ("kv_cache:\n  hot_region_mb: 1\n   warm_region_mb: 2\n", 3, "mapping values"),
        ("model:\n  name_or_path: [unclosed\nmode: hybrid\n", 3, ""),
        ("server:\n  port: 1\n  port: 2\n", 3, "duplicate key 'port'"),
        ("mode: hybrid\nmode: pure_gpu\n", 2, "duplicate key 'mode'"),
    ],
)
def test_bad_yaml_names_file_and_line(tmp_path: Path, text: str, line: int, problem: str) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as err:
        load_config(path)
    message = str(err.value)
    assert message.startswith(f"{path}:{line}: invalid YAML: "), message
    assert problem in message


def test_load_errors_name_file_and_key(tmp_path: Path) -> None:
    path = tmp_path / "hybridgen_config.yaml"
    path.write_text("kv_cache:\n  hot_region_mb: -3\n")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert str(err.value) == f"{path}: kv_cache.hot_region_mb=-3 is out of range: allowed > 0"
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_config(tmp_path / "missing.yaml")


def test_yaml_merge_keys_are_not_duplicates(tmp_path: Path) -> None:
    path = tmp_path / "merge.yaml"
    path.write_text(
        "device_topology:\n  gpu: &gpu {id: 0, memory_mb: 4096}\n"
        "  cpu: {memory_mb: 8192}\nprofile_path: null\n"
        "kv_cache:\n  <<: {hot_region_mb: 1024}\n  hot_region_mb: 2048\n"
    )
    assert load_config(path).kv_cache.hot_region_mb == 2048


def test_tls_needs_both_files_and_mutual_tls_needs_tls() -> None:
    with pytest.raises(ConfigError, match=r"^server\.tls\.key_file=None .*server\.tls\.cert_file"):
        parse_config(_with("server.tls", {"cert_file": "c.pem"}))
    with pytest.raises(ConfigError, match=r"^server\.tls\.cert_file=None .*server\.tls\.key_file"):
        parse_config(_with("server.tls", {"key_file": "k.pem"}))
    with pytest.raises(ConfigError, match=r"^server\.tls\.client_ca_file='ca\.pem' .*TLS"):
        parse_config(_with("server.tls", {"client_ca_file": "ca.pem"}))
    both = parse_config(_with("server.tls", {"cert_file": "c.pem", "key_file": "k.pem"}))
    assert both.server.tls.enabled and not HybridGenConfig().server.tls.enabled


def test_server_files_are_relative_to_the_file(tmp_path: Path) -> None:
    path = tmp_path / "etc" / "hybridgen_config.yaml"
    path.parent.mkdir()
    path.write_text(
        "server:\n  api_key_file: keys\n"
        "  tls: {cert_file: c.pem, key_file: /abs/k.pem, client_ca_file: ca/ca.pem}\n"
    )
    server = load_config(path).server
    assert server.api_key_file == str(path.parent / "keys")
    assert server.tls.cert_file == str(path.parent / "c.pem")
    assert server.tls.key_file == "/abs/k.pem"
    assert server.tls.client_ca_file == str(path.parent / "ca" / "ca.pem")


def test_relative_profile_path_is_relative_to_the_file(tmp_path: Path) -> None:
    path = tmp_path / "etc" / "hybridgen_config.yaml"
    path.parent.mkdir()
    path.write_text("profile_path: tuning_profile.json\n")
    assert load_config(path).profile_path == str(path.parent / "tuning_profile.json")
    path.write_text("profile_path: /var/lib/p.json\n")
    assert load_config(path).profile_path == "/var/lib/p.json"


def test_example_file_is_the_defaults_and_names_every_key() -> None:
    assert load_config(EXAMPLE) == HybridGenConfig()
    data = yaml.safe_load(EXAMPLE.read_text())
    assert sorted(_dotted_data(data)) == sorted(_dotted_fields(HybridGenConfig))


def test_engine_config_mapping() -> None:
    config = parse_config(FULL)
    engine = config.engine_config("cpu")
    assert engine == EngineConfig(
        model="llama3-8b",
        device="cpu",
        dtype="bfloat16",
        gpu_memory_mb=24576,
        host_memory_mb=128000,
        cpu_bandwidth_gbps=204.8,
        gpu_bandwidth_gbps=600.0,
        block_size=32,
        max_num_seqs=8,
        max_num_batched_tokens=512,
        step_latency_ms=40.0,
        max_model_len=8192,
        kv_pool_mb=4096,
        hot_codec="native",
        warm_pool_mb=8192,
        warm_codec="int4",
        hot_turn_tokens=64,
        spill_policy="never",
        warm_draft_tokens=8,
        attn_warm="split",
        prefix_reuse=False,
        sample_placement="cpu",
        pinned_regions=("rope", "attn_warm", "sample"),
        expert_cache_slots=6,
        expert_cpu_max_tokens=2,
        weights_format="int4",
        gpu_layers=20,
        host_layer_compute="stream",
        tuning_warmup_steps=8,
        tuning_interval_ms=250,
        seed=7,
    )
    assert config.engine_config("cuda").device == "cuda:1"
    assert config.engine_config("cuda:0").device == "cuda:0"
    default = HybridGenConfig().engine_config("cpu")
    assert default == EngineConfig(model=DEFAULT_MODEL, device="cpu", dynamic_tuning=True)


def test_engine_config_auto_follows_gpu_id(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    config = parse_config(FULL)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert config.engine_config().device == "cuda:1"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert config.engine_config().device == "auto"


def test_config_error_is_the_engine_one() -> None:
    assert ConfigError is EngineConfigError


def test_with_model_overrides_only_the_model() -> None:
    config = parse_config(FULL)
    assert config.with_model(None) is config
    other = config.with_model("tiny-llama")
    assert other.model.name_or_path == "tiny-llama"
    assert other.model.max_model_len == config.model.max_model_len
    assert other.kv_cache == config.kv_cache


def test_cold_weights_keys() -> None:
    with pytest.raises(ConfigError, match=r"cold_weights\.expert_format='int4' is out of range"):
        parse_config({"cold_weights": {"expert_format": "int4"}})
    with pytest.raises(ConfigError, match=r"cold_weights\.expert_cache_slots=0 is out of range"):
        parse_config({"cold_weights": {"expert_cache_slots": 0}})
    with pytest.raises(ConfigError, match=r"expert_cache_slots=4 .*mode=pure_gpu"):
        parse_config({"mode": "pure_gpu", "cold_weights": {"expert_cache_slots": 4}})
    assert parse_config({}).engine_config("cpu").expert_cache_slots is None
