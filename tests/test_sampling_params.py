"""SamplingParams validation: every bad value is refused, naming the field and the range."""

from __future__ import annotations

import math

import pytest

from hybridgen.sampling.params import InvalidSamplingParameter, SamplingParams
from tests.sampling_helpers import V

# ---------------------------------------------------------------------------------------------
# SamplingParams.validate


BAD_PARAMS = [
    ("temperature", -1.0),
    ("temperature", 100.5),
    ("temperature", math.nan),
    ("temperature", math.inf),
    ("temperature", "1.0"),
    ("top_k", -2),
    ("top_k", V + 1),
    ("top_k", True),
    ("top_k", 2.0),
    ("top_p", 0.0),
    ("top_p", 1.0001),
    ("top_p", math.nan),
    ("min_p", -0.01),
    ("min_p", 1.01),
    ("min_p", math.inf),
    ("repetition_penalty", 0.0),
    ("repetition_penalty", -1.0),
    ("repetition_penalty", 10.5),
    ("repetition_penalty", math.nan),
    ("presence_penalty", -2.01),
    ("presence_penalty", 2.01),
    ("presence_penalty", -math.inf),
    ("frequency_penalty", -2.01),
    ("frequency_penalty", 2.01),
    ("frequency_penalty", math.nan),
    ("max_tokens", 0),
    ("max_tokens", -5),
    ("max_tokens", 1025),  # > max_model_len below
    ("stop_token_ids", (V,)),
    ("stop_token_ids", (3, -1)),
    ("logprobs", -1),
    ("logprobs", 21),
    ("seed", -1),
    ("seed", 2**63),
    ("ignore_eos", 1),
]


@pytest.mark.parametrize(("field", "value"), BAD_PARAMS)
def test_validate_rejects_bad_value(field: str, value: object) -> None:
    params = SamplingParams(**{field: value})
    with pytest.raises(InvalidSamplingParameter) as info:
        params.validate(vocab_size=V, max_model_len=1024)
    assert isinstance(info.value, ValueError)
    assert info.value.field == field
    assert str(info.value).startswith(f"{field}=")
    assert info.value.allowed in str(info.value)


def test_validate_message_format() -> None:
    with pytest.raises(InvalidSamplingParameter) as info:
        SamplingParams(temperature=-1.0).validate(V)
    assert str(info.value) == (
        "temperature=-1.0 is out of range: allowed 0 <= temperature <= 100 (finite)"
    )
    assert info.value.value == -1.0
    assert info.value.allowed == "0 <= temperature <= 100 (finite)"


GOOD_PARAMS = [
    {"temperature": 0.0},
    {"temperature": 100.0},
    {"temperature": 1e-30},
    {"top_k": -1},
    {"top_k": 0},
    {"top_k": 1},
    {"top_k": V},
    {"top_p": 1.0},
    {"top_p": 1e-9},
    {"min_p": 0.0},
    {"min_p": 1.0},
    {"repetition_penalty": 10.0},
    {"repetition_penalty": 1e-6},
    {"presence_penalty": -2.0, "frequency_penalty": 2.0},
    {"presence_penalty": 2.0, "frequency_penalty": -2.0},
    {"max_tokens": 1},
    {"max_tokens": 1024},
    {"stop_token_ids": (0, V - 1)},
    {"logprobs": 0},
    {"logprobs": 20},
    {"seed": 0},
    {"seed": 2**63 - 1},
    {"ignore_eos": True},
]


@pytest.mark.parametrize("kwargs", GOOD_PARAMS)
def test_validate_accepts_boundary_values(kwargs: dict[str, object]) -> None:
    SamplingParams(**kwargs).validate(vocab_size=V, max_model_len=1024)


def test_validate_without_max_model_len_and_list_stop_ids() -> None:
    params = SamplingParams(max_tokens=10**6, stop_token_ids=[1, 2])  # type: ignore[arg-type]
    params.validate(V)
    assert params.stop_token_ids == (1, 2)
    hash(params)  # frozen and hashable


def test_is_greedy() -> None:
    assert SamplingParams(temperature=0).is_greedy
    assert SamplingParams(temperature=0.7, top_k=1).is_greedy
    assert not SamplingParams(temperature=0.7).is_greedy
    assert not SamplingParams(top_k=-1).is_greedy
