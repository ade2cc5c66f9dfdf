"""Integer sampling fields are bounded where they are validated (`MAX_COUNT`, the wire's int32;
seed below 2**63), so no accepted value overflows the sampler's tensors; a top_k beyond the
vocabulary samples as top_k off."""

from __future__ import annotations

import pytest

from kvmesh import LLM, SamplingParams
from kvmesh.engine.errors import InvalidParameterError
from kvmesh.engine.sampling_params import MAX_COUNT
from kvmesh.models.tiny import build_tiny_model

TOO_LARGE = [
    ("top_k", MAX_COUNT + 1),
    ("top_k", 2**63),
    ("n", MAX_COUNT + 1),
    ("max_tokens", 2**63),
    ("min_tokens", 2**63),
    ("seed", 2**64),
    ("logprobs", 2**63),
    ("prompt_logprobs", 2**63),
]


@pytest.fixture(scope="module")
def llm(tmp_path_factory: pytest.TempPathFactory) -> LLM:
    checkpoint = build_tiny_model(tmp_path_factory.mktemp("llama"), "llama", "test", seed=0)
    return LLM(str(checkpoint), num_kv_blocks=32, dtype="float32")


@pytest.mark.parametrize(("field", "value"), TOO_LARGE)
def test_too_large_int_names_its_field(field: str, value: int) -> None:
    fields = {field: value} if field != "min_tokens" else {field: value, "max_tokens": None}
    with pytest.raises(InvalidParameterError, match=f"^{field}:") as info:
        SamplingParams(**fields)  # type: ignore[arg-type]
    assert info.value.field == field


def test_largest_counts_are_accepted() -> None:
    params = SamplingParams(n=MAX_COUNT, top_k=MAX_COUNT, max_tokens=MAX_COUNT, min_tokens=5)
    assert (params.n, params.top_k, params.max_tokens) == (MAX_COUNT, MAX_COUNT, MAX_COUNT)


def test_huge_top_k_is_refused_and_the_engine_serves_on(llm: LLM) -> None:
    """The request is refused before it is scheduled: the next steps are unaffected."""
    with pytest.raises(InvalidParameterError, match=r"^top_k:"):
        llm.generate([[5, 6, 7]], SamplingParams(temperature=1.0, top_k=2**63, max_tokens=2))
    (out,) = llm.generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=2))
    assert len(out.outputs[0].token_ids) == 2


def test_top_k_beyond_the_vocabulary_samples_as_top_k_off(llm: LLM) -> None:
    """Seeded: top_k vocabulary + 1 and MAX_COUNT give the tokens of top_k 0 (batched with a
    top_p row, so the batch's filter pass runs on the seeded row too)."""
    prompts = [[5, 6, 7], [9, 10, 11, 12]]
    tokens = {}
    for top_k in (0, 1025, MAX_COUNT):
        seeded = SamplingParams(top_k=top_k, seed=3, max_tokens=8, ignore_eos=True)
        filtered = SamplingParams(top_p=0.9, seed=4, max_tokens=8, ignore_eos=True)
        outs = llm.generate(prompts, [seeded, filtered])
        tokens[top_k] = [out.outputs[0].token_ids for out in outs]
    assert tokens[1025] == tokens[0] and tokens[MAX_COUNT] == tokens[0]
