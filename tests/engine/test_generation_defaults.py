"""The model's generation_config.json sets the sampling a request leaves unset, as vLLM's
`--generation-config auto` (its default) does; `vllm` keeps the neutral defaults; a request's
own fields win."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvmesh import LLM, SamplingParams
from kvmesh.engine.errors import InvalidParameterError
from kvmesh.models.tiny import tiny_model_path
from kvmesh.service.convert import sampling_from_proto, with_defaults
from kvmesh.v1 import generation_pb2
from tests.checkpoints import with_generation_config

PROMPT = [5, 9, 2, 44, 17]
MODEL_DEFAULTS = {"temperature": 0.7, "top_k": 1, "max_new_tokens": 5, "repetition_penalty": 1.1}


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return with_generation_config(
        tiny_model_path(), tmp_path_factory.mktemp("gen") / "model", **MODEL_DEFAULTS
    )


def token_ids(llm: LLM, params: SamplingParams | None) -> list[int]:
    (out,) = llm.generate([PROMPT], params)
    return list(out.outputs[0].token_ids)


def test_unset_fields_take_the_models_defaults(model: Path) -> None:
    llm = LLM(str(model), num_kv_blocks=32)
    defaults = llm.get_default_sampling_params()
    assert (defaults.temperature, defaults.top_k, defaults.max_tokens) == (0.7, 1, 5)
    assert defaults.repetition_penalty == 1.1
    # top_k 1 samples the most likely token whatever the seed: the model's greedy reply
    greedy = SamplingParams(temperature=0.0, max_tokens=5, repetition_penalty=1.1)
    assert token_ids(llm, None) == token_ids(llm, greedy)
    assert 1 <= len(token_ids(llm, None)) <= 5


def test_neutral_defaults_and_explicit_fields(model: Path) -> None:
    neutral = LLM(str(model), num_kv_blocks=32, generation_config="vllm")
    assert neutral.get_default_sampling_params() == SamplingParams()
    llm = LLM(str(model), num_kv_blocks=32)
    own = SamplingParams(temperature=1.0, seed=3, max_tokens=8, ignore_eos=True)
    assert token_ids(llm, own) == token_ids(neutral, own)  # given fields are not overridden
    assert len(token_ids(llm, own)) == 8


def test_invalid_or_missing_generation_config_names_the_field(tmp_path: Path) -> None:
    bad = with_generation_config(tiny_model_path(), tmp_path / "bad", top_p=0.0)
    with pytest.raises(InvalidParameterError) as caught:
        LLM(str(bad), num_kv_blocks=32)
    assert caught.value.field == "generation_config" and "top_p" in str(caught.value)
    with pytest.raises(InvalidParameterError) as caught:
        LLM(str(tiny_model_path()), num_kv_blocks=32, generation_config=str(tmp_path / "none"))
    assert caught.value.field == "generation_config"


def test_wire_fields_unset_take_the_defaults() -> None:
    defaults = {"temperature": 0.7, "top_k": 1, "max_tokens": 5}
    message = generation_pb2.SamplingParams(temperature=0.0)
    resolved = with_defaults(message, defaults)
    assert (resolved.temperature, resolved.top_k) == (0.0, 1)  # set stays, unset filled
    assert not resolved.HasField("max_tokens")  # a completion without a length keeps 16
    assert sampling_from_proto(with_defaults(message, defaults)).max_tokens == 16
    open_ended = generation_pb2.SamplingParams(max_tokens=-1)  # a chat without a length
    assert sampling_from_proto(with_defaults(open_ended, defaults)).max_tokens == 5
    assert sampling_from_proto(open_ended).max_tokens is None
    assert not message.HasField("top_k")  # the caller's message is not changed


def test_a_length_beyond_the_context_left_ends_at_the_context(model: Path) -> None:
    """max_new_tokens 5 (or an explicit 5) with 3 tokens of context left: the prompt is served
    up to the context and ends "length" (vLLM takes the least of the two); only a length
    beyond the whole context is refused."""
    llm = LLM(str(model), num_kv_blocks=32, max_model_len=64)
    prompt = list(range(10, 71))  # 61 tokens of 64
    (out,) = llm.generate([prompt])
    assert 1 <= len(out.outputs[0].token_ids) <= 3
    (out,) = llm.generate([prompt], SamplingParams(max_tokens=5, ignore_eos=True))
    assert len(out.outputs[0].token_ids) == 3 and out.outputs[0].finish_reason == "length"
    with pytest.raises(InvalidParameterError) as caught:
        llm.generate([prompt], SamplingParams(max_tokens=65))
    assert caught.value.field == "max_tokens"
