"""SamplingParams: vLLM defaults, normalisation, and one typed error per bad value."""

from __future__ import annotations

import math

import pytest

from kvmesh.engine.errors import InvalidParameterError
from kvmesh.engine.sampling_params import (
    MAX_LOGPROBS,
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    SamplingParams,
)


def test_defaults_match_vllm() -> None:
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_k, p.top_p, p.min_p) == (1, 1.0, 0, 1.0, 0.0)
    assert (p.repetition_penalty, p.presence_penalty, p.frequency_penalty) == (1.0, 0.0, 0.0)
    assert (p.max_tokens, p.min_tokens, p.seed, p.logprobs) == (16, 0, None, None)
    assert (p.stop, p.stop_token_ids, p.ignore_eos) == ((), (), False)
    assert p.skip_special_tokens and not p.include_stop_str_in_output
    assert not p.greedy and not p.has_penalties


def test_normalises_sequences_and_numbers() -> None:
    p = SamplingParams(stop="END", stop_token_ids=[5, 7], temperature=0, top_p=1)
    assert p.stop == ("END",)
    assert p.stop_token_ids == (5, 7)
    assert isinstance(p.temperature, float) and p.greedy
    assert isinstance(p.top_p, float)
    assert hash(p) == hash(SamplingParams(stop=["END"], stop_token_ids=(5, 7), temperature=0.0))
    assert SamplingParams(stop=["a", "b"]).stop == ("a", "b")


def test_accepts_boundary_values() -> None:
    SamplingParams(top_k=-1, top_p=1e-9, min_p=1.0, repetition_penalty=2.0)
    SamplingParams(presence_penalty=-2.0, frequency_penalty=2.0, seed=2**63 - 1)
    SamplingParams(logprobs=0, max_tokens=None, min_tokens=100)
    SamplingParams(
        max_tokens=4, min_tokens=4, stop=["x" * MAX_STOP_STRING_CHARS] * MAX_STOP_STRINGS
    )
    assert SamplingParams(repetition_penalty=1.1).has_penalties


INVALID = [
    ("n", 0),
    ("n", 1.5),
    ("temperature", -0.1),
    ("temperature", math.nan),
    ("temperature", math.inf),
    ("temperature", "hot"),
    ("top_p", 0.0),
    ("top_p", 1.01),
    ("top_p", math.nan),
    ("top_k", -2),
    ("top_k", 2.0),
    ("min_p", -0.01),
    ("min_p", 1.5),
    ("repetition_penalty", 0.0),
    ("repetition_penalty", 2.5),
    ("repetition_penalty", -math.inf),
    ("presence_penalty", -2.1),
    ("presence_penalty", 2.1),
    ("frequency_penalty", 3.0),
    ("frequency_penalty", math.nan),
    ("max_tokens", 0),
    ("max_tokens", True),
    ("min_tokens", -1),
    ("logprobs", MAX_LOGPROBS + 1),
    ("logprobs", -1),
    ("seed", -1),
    ("seed", 2**63),
    ("seed", 1.0),
    ("stop", [""]),
    ("stop", ["x" * (MAX_STOP_STRING_CHARS + 1)]),
    ("stop", ["s"] * (MAX_STOP_STRINGS + 1)),
    ("stop", [3]),
    ("stop", 3),
    ("stop_token_ids", [-1]),
    ("stop_token_ids", ["a"]),
    ("stop_token_ids", 5),
    ("ignore_eos", 1),
    ("skip_special_tokens", "yes"),
    ("detokenize", 0),
    ("logit_bias", {1: 100.5}),
    ("logit_bias", {1: math.nan}),
    ("logit_bias", {1: 10**400}),
    ("logit_bias", {-1: 1.0}),
    ("logit_bias", {"1": 1.0}),
    ("logit_bias", {1: True}),
    ("logit_bias", [(1, 1.0), (1, 2.0)]),
    ("logit_bias", [(1, 1.0, 3)]),
    ("logit_bias", "1:1"),
    ("logit_bias", {i: 1.0 for i in range(1025)}),
]


@pytest.mark.parametrize(("field", "value"), INVALID)
def test_invalid_value_names_the_field(field: str, value: object) -> None:
    with pytest.raises(InvalidParameterError, match=f"^{field}:") as info:
        SamplingParams(**{field: value})  # type: ignore[arg-type]
    assert info.value.field == field
    assert isinstance(info.value, ValueError)


def test_min_tokens_above_max_tokens_names_min_tokens() -> None:
    with pytest.raises(InvalidParameterError) as info:
        SamplingParams(max_tokens=4, min_tokens=5)
    assert info.value.field == "min_tokens"


def test_stop_strings_need_detokenize() -> None:
    with pytest.raises(InvalidParameterError) as info:
        SamplingParams(stop=["end"], detokenize=False)
    assert info.value.field == "detokenize"
    assert SamplingParams(stop_token_ids=[7], detokenize=False).stop_token_ids == (7,)


def test_validate_for_model_checks_stop_token_ids() -> None:
    p = SamplingParams(stop_token_ids=[3, 1023])
    p.validate_for_model(1024)
    with pytest.raises(InvalidParameterError) as info:
        p.validate_for_model(1000)
    assert info.value.field == "stop_token_ids"
    assert "1023" in str(info.value)


def test_params_are_frozen() -> None:
    with pytest.raises(AttributeError):
        SamplingParams().temperature = 0.5  # type: ignore[misc]


def test_logit_bias_is_kept_as_sorted_pairs_and_checked_against_the_vocabulary() -> None:
    params = SamplingParams(logit_bias={9: -100, 2: 1.5})
    assert params.logit_bias_pairs == ((2, 1.5), (9, -100.0))
    assert params == SamplingParams(logit_bias=[(9, -100.0), (2, 1.5)])
    assert hash(params) == hash(SamplingParams(logit_bias=((2, 1.5), (9, -100.0))))
    params.validate_for_model(10)
    with pytest.raises(InvalidParameterError, match=r"^logit_bias:") as info:
        params.validate_for_model(9)
    assert "outside the vocabulary" in str(info.value)


def test_the_wire_max_tokens_minus_one_is_no_bound_but_the_context() -> None:
    """The proto's max_tokens -1 converts to None (until the model's maximum length); unset
    keeps the default of 16."""
    from kvmesh.service.convert import sampling_from_proto
    from kvmesh.v1 import generation_pb2

    assert sampling_from_proto(generation_pb2.SamplingParams(max_tokens=-1)).max_tokens is None
    assert sampling_from_proto(generation_pb2.SamplingParams()).max_tokens == 16
    with pytest.raises(InvalidParameterError) as caught:
        sampling_from_proto(generation_pb2.SamplingParams(max_tokens=-2))
    assert caught.value.field == "max_tokens"
