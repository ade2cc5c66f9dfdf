"""Forks (n > 1) of a quantized KV cache: copy-on-write of the shared partial block copies the
quantized values and their scales, on a real tiny model."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvmesh import LLM, SamplingParams
from kvmesh.models.tiny import build_tiny_model

PROMPT = list(range(10, 30))  # 20 tokens: the last block is partial, shared by the forks


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("llama"), "llama", "test", seed=0)


@pytest.mark.parametrize("kv_dtype", ["auto", "int8", "fp8"])
def test_greedy_forks_copy_on_write_equal_a_lone_sequence(checkpoint: Path, kv_dtype: str) -> None:
    """Three greedy completions of one prompt equal the lone completion, their shared block
    copied on write; every block comes back after."""
    llm = LLM(str(checkpoint), num_kv_blocks=64, kv_dtype=kv_dtype)
    greedy = {"temperature": 0.0, "max_tokens": 8, "ignore_eos": True}
    lone = llm.generate([PROMPT], [SamplingParams(**greedy)])[0].outputs[0].token_ids
    many = llm.generate([PROMPT], [SamplingParams(n=3, **greedy)])[0].outputs
    manager = llm.engine.scheduler.block_manager
    assert manager.metrics().cow_copies > 0
    assert [list(out.token_ids) for out in many] == [list(lone)] * 3
    manager.check_integrity()
    assert manager.metrics().in_use_blocks == 0
