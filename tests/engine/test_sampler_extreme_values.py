"""Parameters inside their documented ranges whose float32 form overflows or underflows: a
repetition penalty near 0 (a positive logit divided by it is +inf; one that rounds to 0 turns a
masked -inf into NaN) and a temperature beyond float32's range. The engine must still draw a
token its filters and masks allow, on the CPU kernels (float32) and the torch path (float16,
as on CUDA)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvmesh import LLM, SamplingParams
from kvmesh.models.tiny import build_tiny_model

PROMPT = list(range(10, 30))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("llama"), "llama", "test", seed=0)


@pytest.fixture(scope="module", params=["float32", "float16"])
def llm(request: pytest.FixtureRequest, checkpoint: Path) -> LLM:
    return LLM(str(checkpoint), num_kv_blocks=64, dtype=request.param, device="cpu")


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_penalty_rounding_to_zero_keeps_eos_masked_until_min_tokens(
    llm: LLM, temperature: float
) -> None:
    """EOS in the prompt, a repetition penalty that is 0 in float32: the min_tokens mask holds
    (no EOS among the first min_tokens tokens)."""
    eos = llm.engine.parts.eos_token_ids[0]
    params = SamplingParams(
        temperature=temperature, seed=1, max_tokens=8, min_tokens=8, repetition_penalty=1e-50
    )
    out = llm.generate([[*PROMPT, eos]], params)[0].outputs[0]
    assert eos not in out.token_ids
    assert out.finish_reason == "length"


@pytest.mark.parametrize("temperature", [0.5, 1.0])
def test_a_tiny_repetition_penalty_draws_a_seen_token(llm: LLM, temperature: float) -> None:
    """A penalty of 1e-40 (a float32 subnormal, as the wire carries it) lifts every seen token
    with a positive logit beyond float32's range: the draw stays among the seen tokens."""
    params = SamplingParams(
        temperature=temperature, seed=1, max_tokens=8, ignore_eos=True, repetition_penalty=1e-40
    )
    out = llm.generate([PROMPT], params)[0].outputs[0]
    assert set(out.token_ids) <= set(PROMPT), out.token_ids


def test_a_temperature_beyond_float32_draws_from_the_allowed_tokens(llm: LLM) -> None:
    """temperature 1e39 (float32 inf) with min_tokens masks: a near-uniform draw that never
    takes a masked token (no NaN row, which drew token 0 every step)."""
    stop = 0
    params = SamplingParams(
        temperature=1e39, seed=1, max_tokens=8, min_tokens=8, stop_token_ids=[stop]
    )
    out = llm.generate([PROMPT], params)[0].outputs[0]
    assert stop not in out.token_ids
    assert len(set(out.token_ids)) > 1, out.token_ids
