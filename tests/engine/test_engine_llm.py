"""LLM / LLMEngine end to end (real scheduler, sampler, block manager) vs transformers."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch

from kvmesh import LLM, SamplingParams
from kvmesh.engine.errors import EmptyPromptError, InvalidParameterError
from kvmesh.models.tiny import build_tiny_model

LENGTHS = (5, 21, 70, 70)
MAX_NEW = 12


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("llama"), "llama", "test", seed=0)


def make_prompts() -> list[list[int]]:
    rng = random.Random(2)
    prompts = [[rng.randrange(10, 1000) for _ in range(n)] for n in LENGTHS]
    prompts[3][:40] = prompts[2][:40]  # a shared 40-token prefix (2 full blocks of 16)
    return prompts


@pytest.fixture(scope="module")
def expected(checkpoint: Path) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model: Any = AutoModelForCausalLM.from_pretrained(str(checkpoint), attn_implementation="sdpa")
    result = []
    for prompt in make_prompts():
        out = model.generate(
            torch.tensor([prompt]),
            max_new_tokens=MAX_NEW,
            min_new_tokens=MAX_NEW,
            do_sample=False,
            pad_token_id=0,
        )
        result.append(out[0, len(prompt) :].tolist())
    return result


GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
CONFIGS: dict[str, dict[str, Any]] = {
    "plain": {"enable_chunked_prefill": False, "enable_prefix_caching": False},
    "chunked": {"max_num_batched_tokens": 24, "enable_prefix_caching": False},
    "chunk-cap": {"max_num_batched_tokens": 64, "long_prefill_token_threshold": 8},
    "prefix-cache": {"max_num_batched_tokens": 64},
    "preemption": {"num_kv_blocks": 8, "max_num_batched_tokens": 32},
    "static": {"policy": "static"},
    "contiguous": {"allocation": "contiguous"},
    "prefill-first": {
        "scheduling_policy": "prefill-first",
        "max_num_batched_tokens": 24,
        "max_decode_stall_tokens": 24,
    },
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_greedy_matches_transformers(
    checkpoint: Path, expected: list[list[int]], name: str
) -> None:
    options = {"num_kv_blocks": 256, **CONFIGS[name]}
    llm = LLM(str(checkpoint), **options)
    outputs = llm.generate(make_prompts(), GREEDY)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert all(o.finished and o.outputs[0].finish_reason == "length" for o in outputs)
    if name == "prefix-cache":
        second = llm.generate(make_prompts()[2:], GREEDY)
        assert [o.outputs[0].token_ids for o in second] == expected[2:]
        assert second[0].num_cached_tokens >= 32
    if name == "preemption":
        assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.scheduler.block_manager.num_free_blocks == llm.engine.runner.num_blocks


def test_parallel_sampling_greedy_children_match(
    checkpoint: Path, expected: list[list[int]]
) -> None:
    llm = LLM(str(checkpoint), num_kv_blocks=64)
    params = SamplingParams(n=3, temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    (output,) = llm.generate([make_prompts()[1]], params)
    assert [c.index for c in output.outputs] == [0, 1, 2]
    assert all(c.token_ids == expected[1] for c in output.outputs)


def test_seeded_sampling_independent_of_batch(checkpoint: Path) -> None:
    llm = LLM(str(checkpoint), num_kv_blocks=128)
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=7, max_tokens=10, ignore_eos=True)
    other = SamplingParams(temperature=1.2, max_tokens=6, ignore_eos=True)
    prompts = make_prompts()
    alone = llm.generate([prompts[0]], seeded)[0].outputs[0].token_ids
    mixed = llm.generate(prompts[:3], [seeded, other, other])
    again = llm.generate([*prompts[1:3], prompts[0]], [other, other, seeded])
    assert mixed[0].outputs[0].token_ids == alone
    assert again[2].outputs[0].token_ids == alone


def test_text_prompt_stop_string_and_timings(checkpoint: Path) -> None:
    llm = LLM(str(checkpoint), num_kv_blocks=64)
    full = llm.generate("The quick brown fox", SamplingParams(temperature=0.0, max_tokens=40))[0]
    completion = full.outputs[0]
    assert full.prompt == "The quick brown fox"
    assert len(completion.token_times) == len(completion.token_ids)
    assert full.metrics.ttft is not None and full.metrics.ttft > 0
    assert len(completion.text) >= 2, "the tiny model should produce some byte tokens"
    stop = completion.text[1]
    cut = llm.generate(
        "The quick brown fox", SamplingParams(temperature=0.0, max_tokens=40, stop=[stop])
    )[0].outputs[0]
    assert cut.text == completion.text[: completion.text.index(stop)]
    assert (cut.finish_reason, cut.stop_reason) == ("stop", stop)
    assert cut.token_ids == completion.token_ids[: len(cut.token_ids)]


def test_bad_prompts_raise_typed_errors(checkpoint: Path) -> None:
    llm = LLM(str(checkpoint), num_kv_blocks=64)
    with pytest.raises(InvalidParameterError) as bad_id:
        llm.generate([[1, 2, 5000]])
    assert bad_id.value.field == "prompt_token_ids"
    with pytest.raises(EmptyPromptError):
        llm.generate([[]])
    with pytest.raises(InvalidParameterError) as too_long:
        llm.generate([[1, 2, 3], [1] * 3000])  # the valid first prompt must not stay queued
    assert too_long.value.field in ("prompt", "max_tokens")
    assert not llm.engine.has_unfinished()
