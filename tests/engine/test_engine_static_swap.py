"""The static batching baseline with swap preemption on an engine short of KV blocks: a
swapped-out sequence is swapped back in when the next batch enrolls it (never given a second
table under its id), greedy output equals a roomy engine's, and every block and host slot is
back once all requests finished."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvmesh import LLM, SamplingParams
from kvmesh.models.tiny import build_tiny_model

BLOCK_BYTES = 16384  # the tiny llama: 2 layers x (K, V) x 16 tokens x 2 heads x 32 x 4 bytes
NUM_BLOCKS = 8


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("llama"), "llama", "test", seed=0)


def generate(llm: LLM, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params)]


def test_static_batch_swaps_preempted_sequences_back_in(checkpoint: Path) -> None:
    """Four 20-token prompts (2 blocks each) fill the 8-block pool; their decodes preempt
    each other by swap, and the victims rejoin a later static batch where they stopped."""
    prompts = [[10 + i + 7 * j for j in range(20)] for i in range(4)]
    roomy = LLM(str(checkpoint), num_kv_blocks=64, enable_prefix_caching=False, num_threads=1)
    expected = generate(roomy, prompts, 60)
    llm = LLM(
        str(checkpoint),
        num_kv_blocks=NUM_BLOCKS,
        policy="static",
        preemption="swap",
        host_kv_gib=32 * BLOCK_BYTES / 2**30,
        num_threads=1,
    )
    manager = llm.engine.scheduler.block_manager
    assert manager.tiers is not None
    for attempt in ("cold", "warm"):  # the second pass runs on what the first left cached
        assert generate(llm, prompts, 60) == expected, attempt
        manager.check_integrity()
        assert manager.metrics().in_use_blocks == 0, attempt
        assert manager.num_free_blocks == NUM_BLOCKS, attempt
        assert not manager.tiers.host.parked_ids(), attempt
    assert manager.tiers.swap_stats.swapped_in > 0
