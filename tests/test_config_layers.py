"""`hybridgen serve`'s configuration layers: a flag and a HYBRIDGEN_* variable for every key of
the schema, flag > variable > file > default, where each value came from, and --print-config
printing a file that loads back into the same configuration."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from hybridgen.cli.main import main
from hybridgen.config.file import ConfigError, HybridGenConfig, load_config
from hybridgen.config.layers import (
    config_document,
    format_layered,
    layered_config,
    settings,
    unknown_variables,
)
from hybridgen.models.default_model import DEFAULT_MODEL
from tests.test_config import _dotted_fields

CLI = [sys.executable, "-m", "hybridgen.cli.main"]


def test_every_key_has_a_flag_and_a_variable(capsys: pytest.CaptureFixture[str]) -> None:
    assert [s.key for s in settings()] == _dotted_fields(HybridGenConfig)
    names = {s.key: (s.flag, s.env) for s in settings()}
    # The names the issue asks for, and the ones serve had before the flags were generated.
    assert names["device_topology.gpu.memory_mb"] == ("--gpu-memory-mb", "HYBRIDGEN_GPU_MEMORY_MB")
    assert names["model.max_model_len"][0] == "--max-model-len"
    assert names["kv_cache.hot_codec"][0] == "--kv-hot-codec"
    assert names["server.metrics_port"][0] == "--metrics-port"
    assert names["server.host"][0] == "--host"
    assert names["model.name_or_path"] == ("--model", "HYBRIDGEN_MODEL")
    assert names["server.port"][0] == "--port" and names["server.instance"][0] == "--instance"
    assert all(s.doc for s in settings()), "every key's docstring is its help"
    with pytest.raises(SystemExit) as done:
        main(["serve", "--help"])
    assert done.value.code == 0
    text = capsys.readouterr().out
    for s in settings():
        assert s.flag in text and s.env in text
    assert "--gpu-ids GPUS" in text and "--cpu-cores CPUS" in text  # what each list holds


def _file(tmp_path: Path, data: dict[str, object]) -> Path:
    path = tmp_path / "hybridgen_config.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_flag_over_variable_over_file_over_default(tmp_path: Path) -> None:
    path = _file(
        tmp_path,
        {
            "model": {"max_model_len": 2048, "max_num_seqs": 8},
            "server": {"port": 50100, "metrics_port": 9500},
            "kv_cache": {"hot_codec": "int8"},
        },
    )
    env = {"HYBRIDGEN_MAX_MODEL_LEN": "4096", "HYBRIDGEN_METRICS_PORT": "9600"}
    flags = {"model.max_model_len": "8192", "device_topology.gpu.memory_mb": "24576"}
    layered = layered_config(path, env, flags)
    c = layered.config
    assert c.model.max_model_len == 8192  # flag over variable and file
    assert c.server.metrics_port == 9600  # variable over file
    assert (c.server.port, c.kv_cache.hot_codec, c.model.max_num_seqs) == (50100, "int8", 8)
    assert c.device_topology.gpu.memory_mb == 24576  # flag over default
    assert c.kv_cache.block_size == 16  # default
    s = layered.sources
    assert s["model.max_model_len"] == "flag --max-model-len"
    assert s["server.metrics_port"] == "env HYBRIDGEN_METRICS_PORT"
    assert s["server.port"] == f"file {path}"
    assert s["device_topology.gpu.memory_mb"] == "flag --gpu-memory-mb"
    assert s["kv_cache.block_size"] == "default"
    # Without the flag, the variable; without both, the file.
    assert layered_config(path, env, {}).config.model.max_model_len == 4096
    assert layered_config(path, {}, {}).config == load_config(path)


def test_values_are_typed_by_the_schema(tmp_path: Path) -> None:
    flags = {
        "device_topology.cpu.cores": "0",
        "kv_cache.hot_region_mb": "0.5",
        "kv_cache.prefix_reuse": False,  # --no-kv-prefix-reuse
        "cold_weights.expert_cache_slots": "auto",
        "model.name_or_path": "123",  # a folder named 123 stays a string
        "server.host": "0.0.0.0",
    }
    env = {"HYBRIDGEN_DYNAMIC_TUNING_ENABLE": "off", "HYBRIDGEN_PROFILE_PATH": "p.json"}
    c = layered_config(None, env, flags).config
    assert c.device_topology.cpu.cores == (0,)
    assert c.kv_cache.hot_region_mb == 0.5 and c.kv_cache.prefix_reuse is False
    assert c.cold_weights.expert_cache_slots == "auto"
    assert c.model.name_or_path == "123" and c.server.host == "0.0.0.0"
    assert c.dynamic_tuning.enable is False
    # A relative path given on the command line is relative to the working folder.
    assert c.profile_path == str(Path("p.json").resolve())
    path = _file(tmp_path, {"device_topology": {"gpu": {"memory_mb": 4096}}})
    unset = layered_config(path, {"HYBRIDGEN_GPU_MEMORY_MB": "null"}, {}).config
    assert unset.device_topology.gpu.memory_mb is None


@pytest.mark.parametrize(
    ("env", "flags", "message"),
    [
        ({}, {"kv_cache.hot_codec": "int3"}, "kv_cache.hot_codec='int3'.*set by --kv-hot-codec"),
        ({"HYBRIDGEN_PORT": "0"}, {}, "server.port=0 is out of range.*set by HYBRIDGEN_PORT"),
        ({"HYBRIDGEN_KV_PREFIX_REUSE": "maybe"}, {}, "expected true or false"),
        ({}, {"model.max_num_seqs": "many"}, "model.max_num_seqs='many'.*--max-num-seqs"),
    ],
)
def test_errors_name_the_key_and_where_it_was_set(
    env: dict[str, str], flags: dict[str, object], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        layered_config(None, env, flags)


def test_the_file_alone_is_checked_first(tmp_path: Path) -> None:
    path = _file(tmp_path, {"server": {"prot": 1}})
    with pytest.raises(ConfigError, match=f"{path}: unknown key 'server.prot'"):
        layered_config(path, {}, {"server.port": "50052"})


def test_unknown_variables_are_named_with_the_close_one() -> None:
    env = {"HYBRIDGEN_GPU_MEMORY": "1", "HYBRIDGEN_LOG_LEVEL": "info", "HYBRIDGEN_PORT": "1"}
    assert unknown_variables(env) == [
        "HYBRIDGEN_GPU_MEMORY is not a setting (did you mean HYBRIDGEN_GPU_MEMORY_MB?); ignored"
    ]


def test_printed_config_loads_back_and_names_sources(tmp_path: Path) -> None:
    path = _file(tmp_path, {"kv_cache": {"warm_region_mb": 64}, "profile_path": "prof.json"})
    flags = {"device_topology.cpu.cores": "0,1", "server.metrics_port": "0"}
    layered = layered_config(path, {"HYBRIDGEN_SEED": "7"}, flags)
    text = format_layered(layered)
    assert "memory_mb: null" in text and "# default" in text
    assert "warm_region_mb: 64" in text and f"# file {path}" in text
    assert "seed: 7" in text and "# env HYBRIDGEN_SEED" in text
    assert "metrics_port: 0" in text and "# flag --metrics-port" in text
    printed = tmp_path / "printed.yaml"
    printed.write_text(text)
    assert load_config(printed) == layered.config
    assert yaml.safe_load(text) == config_document(layered.config)


def test_serve_print_config_command(tmp_path: Path) -> None:
    """The issue's command: flags, a variable and the defaults, with their sources."""
    env = {**os.environ, "HYBRIDGEN_MAX_NUM_SEQS": "8"}
    flags = ["--gpu-memory-mb", "24576", "--max-model-len", "8192", "--metrics-port", "0"]
    done = subprocess.run(
        [*CLI, "serve", *flags, "--print-config"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    for wanted in (
        "memory_mb: 24576",
        "max_model_len: 8192",
        "metrics_port: 0",
        "max_num_seqs: 8",
        f'name_or_path: "{DEFAULT_MODEL}"',
    ):
        line = next(x for x in lines if x.strip().startswith(wanted))
        source = line.split("# ")[1]
        assert (
            source
            == {
                "memory_mb: 24576": "flag --gpu-memory-mb",
                "max_model_len: 8192": "flag --max-model-len",
                "metrics_port: 0": "flag --metrics-port",
                "max_num_seqs: 8": "env HYBRIDGEN_MAX_NUM_SEQS",
                f'name_or_path: "{DEFAULT_MODEL}"': "default",
            }[wanted]
        )
    assert not list(tmp_path.iterdir())  # printing starts nothing and writes nothing


def test_every_variable_the_code_reads_is_known() -> None:
    """A HYBRIDGEN_* variable read anywhere is a setting or listed as another one, so that
    serve never calls it unknown."""
    root = Path(__file__).resolve().parents[1]
    read = set()
    for folder in ("shared", "gpu_daemon", "cpu_daemon", "gateway", "bench/hybridgen"):
        for path in (root / folder).rglob("*.py"):
            read |= set(re.findall(r"HYBRIDGEN_[A-Z][A-Z_]*[A-Z]", path.read_text()))
    assert read, "the pattern finds the variables"
    assert unknown_variables(dict.fromkeys(read, "")) == []
