"""Prompt logprobs against transformers' own forward (float32): every prompt token's
log-probability given the tokens before it, its rank and the top-k there, whichever way the
prompt was computed (one chunk or several, after a preemption, with the prefix cache holding
the same prompt, n > 1), and the request's own tokens unchanged."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from kvmesh import LLM, SamplingParams
from kvmesh.engine.errors import InvalidParameterError
from kvmesh.engine.outputs import RequestOutput
from kvmesh.engine.scheduler.stops import MAX_PROMPT_LOGPROB_ENTRIES, check_prompt_logprobs
from kvmesh.models.tiny import build_tiny_model

PROMPT = [(11 * i + 5) % 900 + 10 for i in range(70)]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("llama"), "llama", "test", seed=0)


def hf_prompt_logprobs(path: Path, prompt: list[int]) -> torch.Tensor:
    """[len(prompt) - 1, vocab]: log_softmax of transformers' logits at positions 0 .. L-2."""
    from transformers import AutoModelForCausalLM

    model: Any = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    with torch.inference_mode():
        logits = model(torch.tensor([prompt])).logits[0, :-1].float()  # [L - 1, vocab]
    return logits.log_softmax(dim=-1)


def check_against(expected: torch.Tensor, output: RequestOutput, top: int) -> None:
    entries = output.prompt_logprobs
    assert entries is not None and len(entries) == len(PROMPT) and entries[0] is None
    for position, entry in enumerate(entries[1:]):
        assert entry is not None
        row = expected[position]  # [vocab]: the logits at the token before
        token = PROMPT[position + 1]
        assert entry.sampled_token_id == token
        assert entry.sampled_logprob == pytest.approx(float(row[token]), abs=2e-4)
        assert entry.sampled_rank == int((row > row[token]).sum()) + 1
        assert list(entry.top_token_ids) == row.topk(top).indices.tolist()
        assert torch.allclose(torch.tensor(entry.top_logprobs), row.topk(top).values, atol=2e-4)


def test_prompt_logprobs_match_transformers_however_the_prompt_ran(checkpoint: Path) -> None:
    expected = hf_prompt_logprobs(checkpoint, PROMPT)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, prompt_logprobs=3)
    whole = LLM(str(checkpoint), num_kv_blocks=64, dtype="float32")
    plain = whole.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    (first,) = whole.generate([PROMPT], params)  # the prompt is in the prefix cache by now
    check_against(expected, first, 3)
    assert first.num_cached_tokens == 0  # computed whole, not read from the cache
    assert first.outputs[0].token_ids == plain[0].outputs[0].token_ids
    assert plain[0].prompt_logprobs is None
    chunked = LLM(str(checkpoint), num_kv_blocks=64, dtype="float32", max_num_batched_tokens=16)
    (second,) = chunked.generate([PROMPT], params)  # five chunks of at most 16 tokens
    check_against(expected, second, 3)
    assert second.outputs[0].token_ids == first.outputs[0].token_ids
    sampled = SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=3, prompt_logprobs=0)
    (forked,) = whole.generate([PROMPT], sampled)
    check_against(expected, forked, 0)
    assert len(forked.outputs) == 2


def test_preempted_prompt_is_scored_once(checkpoint: Path) -> None:
    """A request preempted (recomputed from scratch) halfway through its chunked prompt still
    gets one entry per prompt token: six blocks hold a growing 40-token request and part of
    the 70-token prompt, so the prompt's sequence, the newest, is preempted mid-prompt."""
    expected = hf_prompt_logprobs(checkpoint, PROMPT)
    llm = LLM(str(checkpoint), num_kv_blocks=6, block_size=16, dtype="float32",
              max_num_batched_tokens=16, enable_prefix_caching=False)  # fmt: skip
    grower = SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True)
    scored = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, prompt_logprobs=2)
    alone = LLM(str(checkpoint), num_kv_blocks=64, dtype="float32")
    (reference,) = alone.generate([PROMPT], scored)
    _, output = llm.generate([PROMPT[:40], PROMPT], [grower, scored])
    assert llm.engine.scheduler.num_preemptions > 0
    check_against(expected, output, 2)
    assert output.outputs[0].token_ids == reference.outputs[0].token_ids


def test_prompt_logprobs_out_of_range_is_refused() -> None:
    for value in (-1, 21):
        with pytest.raises(InvalidParameterError, match="prompt_logprobs"):
            SamplingParams(prompt_logprobs=value)


def test_prompt_rows_run_and_score_in_inference_mode(checkpoint: Path) -> None:
    """The step that keeps prompt rows runs without autograd, as every other step does (a
    compiled executor would otherwise recompile for the grad mode)."""
    llm = LLM(str(checkpoint), num_kv_blocks=64, dtype="float32")
    runner = llm.engine.runner
    modes: list[bool] = []
    forward, logits = runner.executor.forward, runner.executor.compute_logits

    def spy_forward(*args: Any) -> torch.Tensor:
        modes.append(torch.is_inference_mode_enabled())
        return forward(*args)

    def spy_logits(hidden: torch.Tensor) -> torch.Tensor:
        modes.append(torch.is_inference_mode_enabled())
        return logits(hidden)

    runner.executor.forward, runner.executor.compute_logits = spy_forward, spy_logits  # type: ignore[method-assign]
    llm.generate([PROMPT], SamplingParams(max_tokens=1, prompt_logprobs=1))
    assert modes and all(modes)


def test_a_prompt_whose_entries_would_not_fit_one_answer_is_refused() -> None:
    bound = MAX_PROMPT_LOGPROB_ENTRIES
    check_prompt_logprobs(20, bound // 21)
    check_prompt_logprobs(None, 10 * bound)
    with pytest.raises(InvalidParameterError, match="prompt_logprobs"):
        check_prompt_logprobs(20, bound // 21 + 1)
