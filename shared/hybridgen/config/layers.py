"""`hybridgen serve`'s configuration in four layers, and where each value came from:

    command-line flag  >  HYBRIDGEN_* environment variable  >  config file  >  default

The flags and variables are generated from the one schema (config.HybridGenConfig), one per
dotted key, so a key added to a section has both. A key's flag is its dotted path with
dashes, with the section left out for the common sections and kv_cache shortened to kv
(`device_topology.gpu.memory_mb` is --gpu-memory-mb, `kv_cache.hot_codec` --kv-hot-codec,
`placements.sample` --placements-sample); model.name_or_path is --model. Its variable is the
flag in capitals: HYBRIDGEN_GPU_MEMORY_MB.
"""

from __future__ import annotations

import ast
import copy
import dataclasses
import difflib
import functools
import inspect
import itertools
import json
import textwrap
import types
import typing
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from hybridgen.config.file import (
    ConfigError,
    HybridGenConfig,
    parse_config,
    read_config_file,
    relative_to_file,
)

__all__ = [
    "ENV_PREFIX",
    "Layered",
    "Setting",
    "config_document",
    "flag_for",
    "format_layered",
    "layered_config",
    "settings",
    "unknown_variables",
]

ENV_PREFIX = "HYBRIDGEN_"
OTHER_VARIABLES = frozenset({"CONFIG", "LOG_LEVEL", "LOG_JSON", "COMMIT", "FAULT_STEPS", "GO_FD"})
"""HYBRIDGEN_* variables that are not settings: the config file, logging, the commit
benchmarks record, the fault drill, a prestarted child's go pipe (runtime/prestart.py)."""
_SHORT_SECTIONS = {"device_topology": "", "model": "", "server": "", "kv_cache": "kv"}
_FLAG_NAMES = {"model.name_or_path": "model"}
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


@dataclass(frozen=True)
class Setting:
    """One leaf key of the schema and the names it goes by."""

    key: str
    """Dotted key, as in the file: kv_cache.hot_codec."""
    flag: str
    """Command-line flag: --kv-hot-codec."""
    env: str
    """Environment variable: HYBRIDGEN_KV_HOT_CODEC."""
    hint: Any
    """The field's annotation."""
    default: Any
    """The schema's default."""
    doc: str
    """The field's docstring, on one line."""

    @property
    def is_bool(self) -> bool:
        return self.hint is bool

    @property
    def names_a_file(self) -> bool:
        """A path key (profile_path, server.tls.cert_file, ...): relative ones are taken
        relative to the file that sets them, or to the working folder for a flag or variable."""
        return self.key.endswith("_file") or self.key == "profile_path"  # not a model name

    @property
    def metavar(self) -> str:
        """What the flag takes, for --help: {native,int8,int4}, N, X, TEXT, CPUS, GPUS or
        ORIGINS (the comma-separated lists)."""
        names = [_metavar(a) for a in typing.get_args(self.hint) if a is not type(None)]
        shown = "|".join(names) if names and _optional(self.hint) else _metavar(self.hint)
        if self.key == "server.cors_origins":
            return "ORIGINS"
        return shown.replace("CPUS", "GPUS") if ".gpu." in self.key else shown  # id lists

    def parse(self, text: str, where: str) -> object:
        """The value a flag or variable spells, typed for the schema to check."""
        word = text.strip()
        if self.is_bool:
            if word.lower() in _TRUE + _FALSE:
                return word.lower() in _TRUE
            raise ConfigError(
                f"{self.key}={text!r} has the wrong type: expected true or false (set by {where})"
            )
        if word.lower() in ("null", "none") and _optional(self.hint):
            return None
        if self.names_a_file:  # relative to the working folder, where it was typed
            return str(Path(word).expanduser().resolve())
        if _is_text(self.hint):
            return text
        import yaml

        try:
            return yaml.safe_load(word)
        except yaml.YAMLError:
            return text  # the schema then names the key and what it allows


@dataclass(frozen=True)
class Layered:
    """A checked config, and for every dotted key where its value came from."""

    config: HybridGenConfig
    """The merged configuration."""
    sources: dict[str, str]
    """Dotted key -> 'flag --x', 'env HYBRIDGEN_X', 'file PATH' or 'default'."""
    file: Path | None
    """The config file, if one was given."""


def _optional(hint: Any) -> bool:
    return typing.get_origin(hint) in (typing.Union, types.UnionType) and type(None) in (
        typing.get_args(hint)
    )


def _is_text(hint: Any) -> bool:
    """Whether every value of `hint` is a string, so flag text is taken as written (a
    model folder named 123, a host, a CPU list)."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        inner = [a for a in typing.get_args(hint) if a is not type(None)]
        return all(_is_text(a) for a in inner)
    if origin is Literal:
        return all(isinstance(c, str) for c in typing.get_args(hint))
    return hint is str or (origin is tuple)  # tuples: CPU lists, parsed from their text


def _metavar(hint: Any) -> str:
    if typing.get_origin(hint) is Literal:
        return "{" + ",".join(str(c) for c in typing.get_args(hint)) + "}"
    if typing.get_origin(hint) is tuple:
        return "CPUS"
    return {int: "N", float: "X", str: "TEXT"}.get(hint, "V")


def flag_for(key: str) -> str:
    """The command-line flag of a dotted key: --gpu-memory-mb for device_topology.gpu.memory_mb."""
    if key in _FLAG_NAMES:
        return f"--{_FLAG_NAMES[key]}"
    section, *rest = key.split(".")
    if not rest:
        return "--" + section.replace("_", "-")
    head = _SHORT_SECTIONS.get(section, section)
    return "--" + "-".join([head, *rest] if head else rest).replace("_", "-")


@functools.cache
def _docstrings(cls: type) -> dict[str, str]:
    """Each field's docstring (the string under it in the class body), on one line."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs = {}
    for node, after in itertools.pairwise(body):
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        if isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant):
            docs[node.target.id] = " ".join(str(after.value.value).split())
    return docs


def _walk(cls: type, prefix: str) -> Iterator[Setting]:
    hints = typing.get_type_hints(cls)
    docs = _docstrings(cls)
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        hint, key = hints[f.name], f"{prefix}{f.name}"
        if isinstance(hint, type) and dataclasses.is_dataclass(hint):
            yield from _walk(hint, f"{key}.")
            continue
        flag = flag_for(key)
        env = ENV_PREFIX + flag.removeprefix("--").replace("-", "_").upper()
        yield Setting(key, flag, env, hint, f.default, docs.get(f.name, ""))


@functools.cache
def settings() -> tuple[Setting, ...]:
    """Every leaf key of the schema, in the order of the file."""
    found = tuple(_walk(HybridGenConfig, ""))
    for attr in ("flag", "env"):
        names = [getattr(s, attr) for s in found]
        twice = {n for n in names if names.count(n) > 1}
        if twice:  # a new key must not shadow another's flag
            raise AssertionError(f"config keys share the {attr} {sorted(twice)}")
    return found


def _set(data: dict[str, Any], key: str, value: object) -> None:
    *parents, leaf = key.split(".")
    for part in parents:
        child = data.get(part)
        if not isinstance(child, dict):
            child = data[part] = {}  # absent, or empty (`kv_cache:`) in the file
        data = child
    data[leaf] = value


def _has(data: Mapping[str, Any], key: str) -> bool:
    *parents, leaf = key.split(".")
    for part in parents:
        child = data.get(part)
        if not isinstance(child, Mapping):
            return False
        data = child
    return leaf in data


def unknown_variables(environ: Mapping[str, str]) -> list[str]:
    """A line for each HYBRIDGEN_* variable that names no setting (a typo would otherwise be
    silently ignored), with the closest one."""
    known = {s.env for s in settings()} | {ENV_PREFIX + o for o in OTHER_VARIABLES}
    lines = []
    for name in sorted(environ):
        if name.startswith(ENV_PREFIX) and name not in known:
            close = difflib.get_close_matches(name, sorted(known), n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            lines.append(f"{name} is not a setting{hint}; ignored")
    return lines


def layered_config(
    path: str | Path | None, environ: Mapping[str, str], flags: Mapping[str, object]
) -> Layered:
    """The config of `path` (None: none), overridden by the HYBRIDGEN_* variables of
    `environ`, overridden by `flags` (dotted key -> flag text; None: not given). Errors name
    the key and, for a flag or variable, which one."""
    file = Path(path) if path is not None else None
    data = read_config_file(file) if file is not None else {}
    if file is not None:  # the file alone first, so that its own mistakes name it
        try:
            parse_config(data)
        except ConfigError as exc:
            raise ConfigError(f"{file}: {exc}") from exc
    merged = copy.deepcopy(data)
    sources = {s.key: f"file {file}" if _has(data, s.key) else "default" for s in settings()}
    for s in settings():
        if s.env in environ:
            _set(merged, s.key, s.parse(environ[s.env], s.env))
            sources[s.key] = f"env {s.env}"
        text = flags.get(s.key)
        if text is not None:
            value = text if isinstance(text, bool) else s.parse(str(text), s.flag)
            _set(merged, s.key, value)
            sources[s.key] = f"flag {s.flag}"
    try:
        config = parse_config(merged)
    except ConfigError as exc:
        raise ConfigError(_with_source(str(exc), sources)) from exc
    if file is not None:  # the file's relative paths; those given here are absolute by now
        config = relative_to_file(config, file)
    return Layered(config, sources, file)


def _with_source(message: str, sources: Mapping[str, str]) -> str:
    """`message` naming the flag or variable that set the key it is about."""
    given = [k for k, where in sources.items() if where.startswith(("flag ", "env "))]
    named = [k for k in given if k in message]
    if not named:
        return message
    key = max(named, key=len)  # kv_cache.hot_region_mb, not a key it contains
    return f"{message} (set by {sources[key].split(' ', 1)[1]})"


def _value(config: HybridGenConfig, key: str) -> object:
    value: Any = config
    for part in key.split("."):
        value = getattr(value, part)
    return value


def _plain(value: object) -> object:
    """A value as the file spells it: a CPU list as text."""
    return ",".join(str(v) for v in value) if isinstance(value, tuple) else value


def _scalar(value: object) -> str:
    return json.dumps(_plain(value))  # a JSON scalar is YAML too


def config_document(config: HybridGenConfig) -> dict[str, Any]:
    """`config` as the YAML document that loads back into it."""
    data: dict[str, Any] = {}
    for s in settings():
        _set(data, s.key, _plain(_value(config, s.key)))
    return data


def format_layered(layered: Layered) -> str:
    """The merged config as YAML, each value with a comment saying where it came from."""
    lines = ["# flag > HYBRIDGEN_* environment variable > config file > default"]
    open_path: list[str] = []
    for s in settings():
        *parents, leaf = s.key.split(".")
        common = 0
        while common < min(len(parents), len(open_path)) and parents[common] == open_path[common]:
            common += 1
        for depth in range(common, len(parents)):
            lines.append(f"{'  ' * depth}{parents[depth]}:")
        open_path = parents
        text = f"{'  ' * len(parents)}{leaf}: {_scalar(_value(layered.config, s.key))}"
        lines.append(f"{text:<44} # {layered.sources[s.key]}")
    return "\n".join(lines)
