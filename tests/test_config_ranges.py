"""config/ranges.py declares each setting's range once: the config file and EngineConfig both
accept a value at the declared bound and reject one just outside it, in the same words, so
the two cannot drift apart."""

from __future__ import annotations

import dataclasses
import math
import typing
from typing import Any

import pytest

from hybridgen.config.engine import ConfigError, EngineConfig
from hybridgen.config.file import parse_config
from hybridgen.config.ranges import CHOICES, RANGES, Range

BESIDE: dict[str, dict[str, object]] = {
    "model.max_num_seqs": {"model.max_num_batched_tokens": 4096},  # room for 4096 sequences
    "cold_weights.expert_format": {"cold_weights.expert_cache_slots": 1},  # int8, int4 need it
}
"""Other settings a probe needs beside it, so that only the probed value decides."""


def _document(values: dict[str, object]) -> dict[str, Any]:
    data: dict[str, Any] = {}
    for key, value in values.items():
        *parents, leaf = key.split(".")
        node = data
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return data


def _engine(key: str, value: object | None = None) -> EngineConfig:
    """The EngineConfig of a file that sets `key` to `value` (None: leaves it out)."""
    values = dict(BESIDE.get(key, {}))
    if value is not None:
        values[key] = value
    return parse_config(_document(values)).engine_config("cpu")


def _past(bound: float, direction: float) -> float:
    """The nearest value beyond `bound` (an int: the next integer)."""
    if isinstance(bound, int):
        return bound + int(direction)
    return math.nextafter(bound, direction * math.inf)


def _probes(allowed: Range) -> tuple[list[object], list[object]]:
    """Values at the bounds (allowed), and just outside them (refused)."""
    inside: list[object] = ["auto"] if allowed.auto else []
    outside: list[object] = [] if allowed.auto else ["auto"]
    if allowed.above:
        inside.append(_past(allowed.low, 1))
        outside.append(allowed.low)
    else:
        inside.append(allowed.low)
        outside.append(_past(allowed.low, -1))
    if allowed.high is not None:
        inside.append(allowed.high)
        outside.append(_past(allowed.high, 1))
    return inside, outside


def _words(choices: tuple[object, ...]) -> str:
    *first, last = (str(c) for c in choices)
    return f"{', '.join(first)} or {last}"


@pytest.mark.parametrize("key", sorted(RANGES))
def test_range_is_one_declaration(key: str) -> None:
    field, allowed = RANGES[key].field, RANGES[key].range
    inside, outside = _probes(allowed)
    for value in inside:  # the file takes it, and it reaches EngineConfig's field as it is
        assert getattr(_engine(key, value), field) == value, (key, value)
    base = _engine(key)
    for value in outside:
        with pytest.raises(ConfigError) as in_file:
            _engine(key, value)
        with pytest.raises(ConfigError) as in_engine:
            dataclasses.replace(base, **{field: value})
        if value != "auto":  # a string where a number goes is a type error in the file
            assert (
                str(in_file.value) == f"{key}={value!r} is out of range: allowed {allowed.allowed}"
            )
        assert (
            str(in_engine.value) == f"{field}={value!r} is out of range: allowed {allowed.allowed}"
        )


@pytest.mark.parametrize("key", sorted(CHOICES))
def test_choices_are_one_declaration(key: str) -> None:
    chosen = CHOICES[key]
    for value in typing.get_args(chosen.hint):
        assert getattr(_engine(key, value), chosen.field) == value, (key, value)
    base = _engine(key)
    for value in chosen.choices:  # "auto" where the engine measures what the file leaves null
        assert getattr(dataclasses.replace(base, **{chosen.field: value}), chosen.field) == value
    with pytest.raises(ConfigError) as in_file:
        _engine(key, "bogus")
    listed = f"{key}='bogus' is out of range: allowed one of " + ", ".join(
        str(c) for c in typing.get_args(chosen.hint)
    )
    assert str(in_file.value) in (listed, f"{listed} or null")  # null: where it is optional
    with pytest.raises(ConfigError) as in_engine:
        dataclasses.replace(base, **{chosen.field: "bogus"})
    expected = f"{chosen.field}='bogus' is out of range: allowed {_words(chosen.choices)}"
    assert str(in_engine.value) == expected
