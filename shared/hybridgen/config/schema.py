"""The generic walk behind hybridgen_config.yaml's schema (config/file.py): a mapping checked
against a frozen dataclass, by its annotations (Literal: choices; `X | None`: optional) and its
fields' metadata (ranges, parse hooks). Errors name the dotted key and what is allowed."""

from __future__ import annotations

import dataclasses
import difflib
import re
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import field
from typing import Any, Literal, TypeVar

import yaml

from hybridgen.config.engine import ConfigError
from hybridgen.config.ranges import RANGES, Range

T = TypeVar("T")


def checked(default: Any, check: Callable[[Any], object], allowed: str) -> Any:
    """A field whose non-null value must pass `check`; `allowed` words the range for errors."""
    return field(default=default, metadata={"check": check, "allowed": allowed})


def in_range(default: Any, allowed: Range) -> Any:
    """A numeric field whose non-null value must be in `allowed`."""
    return checked(default, allowed.allows, allowed.allowed)


def at_least(default: Any, low: float) -> Any:
    return in_range(default, Range(low))


def between(default: Any, low: float, high: float) -> Any:
    return in_range(default, Range(low, high))


def shared(default: Any, key: str) -> Any:
    """The field at dotted `key`, whose range config/ranges.py declares for EngineConfig too."""
    return in_range(default, RANGES[key].range)


class StrictLoader(yaml.SafeLoader):
    """SafeLoader that rejects duplicate keys, which PyYAML silently resolves to the last."""

    def construct_mapping(self, node: Any, deep: bool = False) -> Any:
        seen: set[str] = set()
        for key_node, _ in node.value:
            if not isinstance(key_node, yaml.ScalarNode) or key_node.tag.endswith(":merge"):
                continue
            if key_node.value in seen:
                raise yaml.constructor.ConstructorError(
                    "while constructing a mapping",
                    node.start_mark,
                    f"duplicate key {key_node.value!r}",
                    key_node.start_mark,
                )
            seen.add(key_node.value)
        return super().construct_mapping(node, deep=deep)


def build(cls: type[T], data: object, prefix: str) -> T:
    """An instance of the dataclass `cls` from a mapping whose keys sit under `prefix`."""
    if data is None:
        data = {}  # `kv_cache:` with every child commented out
    if not isinstance(data, Mapping):
        where = prefix.rstrip(".") or "the config"
        raise ConfigError(f"{where} must be a mapping of keys, got {data!r}")
    fields = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    hints = typing.get_type_hints(cls)
    for key in data:
        if key not in fields:
            close = difflib.get_close_matches(str(key), list(fields), n=1)
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            known = ", ".join(fields)
            raise ConfigError(f"unknown key '{prefix}{key}'{hint}; known keys: {known}")
    values = {
        name: field_value(hints[name], value, fields[name].metadata, f"{prefix}{name}")
        for name, value in data.items()
    }
    built = cls(**values)
    validate = getattr(built, "_validate", None)
    if validate is not None:
        validate(prefix)
    return built


def field_value(hint: Any, value: object, metadata: Mapping[str, Any], key: str) -> object:
    parse = metadata.get("parse")
    if value is not None and parse is not None:
        return parse(value, key)
    typed = typed_value(hint, value, key)
    check = metadata.get("check")
    if typed is not None and check is not None and not check(typed):
        # The value as written (-1, not the widened -1.0), so the user finds it in the file.
        raise ConfigError(f"{key}={value!r} is out of range: allowed {metadata['allowed']}")
    return typed


TYPE_NAMES = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}


def typed_value(hint: Any, value: object, key: str, optional: bool = False) -> object:
    """`value` if it has the annotated type (ints widen to float, bools never count as ints)."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None:
            return None
        inner = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(inner) == 1:
            return typed_value(inner[0], value, key, optional=True)
        for alternative in inner:  # the first type that takes the value
            try:
                return typed_value(alternative, value, key)
            except ConfigError:
                continue
        names = [_describe(a) for a in inner]
        raise ConfigError(f"{key}={value!r} is out of range: allowed {' or '.join(names)} or null")
    if origin is Literal:
        choices = typing.get_args(hint)
        if any(type(value) is type(c) and value == c for c in choices):
            return value
        allowed = ", ".join(str(c) for c in choices) + (" or null" if optional else "")
        raise ConfigError(f"{key}={value!r} is out of range: allowed one of {allowed}")
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        return build(hint, value, f"{key}.")
    if hint is float and type(value) is int:
        return float(value)
    if type(value) is hint:
        return value
    expected = TYPE_NAMES.get(hint, str(hint)) + (" or null" if optional else "")
    raise ConfigError(f"{key}={value!r} has the wrong type: expected {expected}")


def _describe(hint: Any) -> str:
    """What a type annotation allows, in an error message."""
    if typing.get_origin(hint) is Literal:
        return ", ".join(str(c) for c in typing.get_args(hint))
    return TYPE_NAMES.get(hint, str(hint))


_MAX_CPUS = 8192


def parse_device_ids(value: object, key: str = "ids") -> tuple[int, ...]:
    """Distinct CUDA device ids >= 0, written as a YAML list such as [0, 1]."""
    if not isinstance(value, list) or not all(type(v) is int and v >= 0 for v in value):
        raise ConfigError(
            f"{key}={value!r} has the wrong type: expected a list of device ids >= 0 such as [0, 1]"
        )
    if len(set(value)) != len(value) or not value:
        raise ConfigError(f"{key}={value!r} is out of range: allowed distinct device ids")
    return tuple(value)


_ORIGIN = re.compile(r"https?://[^/\s:]+(:[0-9]{1,5})?")


def parse_origins(value: object, key: str = "cors_origins") -> tuple[str, ...]:
    """Browser origins: "*" (any) or scheme://host[:port] each, as a YAML list or as text
    separated by commas (a flag, a variable, the printed config)."""
    if isinstance(value, str):
        value = [v.strip() for v in value.split(",") if v.strip()]
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ConfigError(
            f"{key}={value!r} has the wrong type: expected a list of origins such as "
            "['http://localhost:3000'] or ['*']"
        )
    bad = [v for v in value if v != "*" and not _ORIGIN.fullmatch(v)]
    if bad:
        raise ConfigError(
            f"{key}={bad[0]!r} is out of range: allowed '*' or an origin such as "
            "'https://chat.example.com' or 'http://localhost:3000' (no path)"
        )
    return tuple(value)


def parse_cpu_list(value: object, key: str = "cores") -> tuple[int, ...]:
    """CPU ids of a list such as "0-15" or "0,2,4-7" (the cpuset / taskset -c syntax)."""

    def bad(why: str) -> ConfigError:
        return ConfigError(
            f"{key}={value!r} is out of range: allowed a CPU list such as '0-15' or "
            f"'0,2,4-7' ({why})"
        )

    # A bare YAML integer is ambiguous (the article's `cores: 32` is a count, cpuset's "32"
    # is CPU 32), so only the quoted list form is accepted.
    if not isinstance(value, str):
        raise ConfigError(
            f"{key}={value!r} has the wrong type: expected a quoted CPU list such as "
            "'0-15', '0,2,4-7' or '3'"
        )
    cpus: set[int] = set()
    for part in value.replace(" ", "").split(","):
        match = re.fullmatch(r"(\d+)(?:-(\d+))?", part)
        if match is None:
            raise bad(f"{part!r} is not N or N-M")
        first, last = int(match[1]), int(match[2] or match[1])
        if first > last:
            raise bad(f"{part!r} runs backwards")
        if last >= _MAX_CPUS:
            raise bad(f"CPU ids stop below {_MAX_CPUS}")
        cpus.update(range(first, last + 1))
    return tuple(sorted(cpus))
