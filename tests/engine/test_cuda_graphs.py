"""Decode-step CUDA graphs: bucket choice, static-buffer padding, and the padded decode step.

No GPU here: the padded static-buffer step runs eagerly (`capture=False`, the exact inputs a
graph replays) and must keep transformers' greedy tokens; bench/gpu_check.py compares the
captured graphs with eager steps on a GPU.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvmesh import LLM, SamplingParams
from kvmesh.engine.attention import ForwardContext
from kvmesh.engine.cuda_graphs import (
    PAD_SLOT,
    StaticDecodeInputs,
    bucket_for,
    graph_buckets,
    is_graph_step,
)
from kvmesh.models.tiny import build_tiny_model
from tests.engine.test_native_executor import PROMPT, hf_greedy


def test_buckets_end_at_max_num_seqs_and_pick_the_smallest_fit() -> None:
    assert graph_buckets(256)[-1] == 256 and graph_buckets(256)[:4] == (1, 2, 4, 8)
    assert graph_buckets(20) == (1, 2, 4, 8, 16, 20)
    assert graph_buckets(1) == (1,)
    buckets = graph_buckets(20)
    assert [bucket_for(n, buckets) for n in (1, 3, 8, 9, 17, 20)] == [1, 4, 8, 16, 20, 20]
    assert bucket_for(21, buckets) is None and bucket_for(0, buckets) is None
    with pytest.raises(ValueError, match="max_num_seqs"):
        graph_buckets(0)


def decode_context(cache_rows: int = 3) -> tuple[torch.Tensor, torch.Tensor, ForwardContext]:
    from kvmesh_kernels.cache import KVCacheSpec, allocate_kv_cache

    spec = KVCacheSpec(
        num_blocks=16, num_layers=1, block_size=4, num_kv_heads=2, head_dim=64,
        dtype=torch.float32, kv_dtype="auto",
    ).validate()  # fmt: skip
    cache = allocate_kv_cache(spec, device=torch.device("cpu"))
    tables = torch.tensor([[3, 4], [5, 0], [6, 7]], dtype=torch.int32)[:cache_rows]
    seq_lens = torch.tensor([6, 2, 8], dtype=torch.int32)[:cache_rows]
    starts = torch.arange(cache_rows + 1, dtype=torch.int32)
    slots = torch.tensor([17, 21, 27])[:cache_rows]
    ctx = ForwardContext(cache, slots, tables, seq_lens, starts, cache_rows, cache_rows)
    return torch.tensor([5, 6, 7])[:cache_rows], seq_lens.long() - 1, ctx


def test_static_inputs_copy_the_step_and_pad_to_the_bucket() -> None:
    ids, positions, ctx = decode_context()
    inputs = StaticDecodeInputs(rows=8, max_blocks=5, device=torch.device("cpu"))
    inputs.block_tables.fill_(9)  # stale contents from an earlier, wider step
    inputs.load(ids, positions, ctx, bucket=4)
    assert inputs.input_ids[:4].tolist() == [5, 6, 7, 0]
    assert inputs.positions[:4].tolist() == [5, 1, 7, 0]
    assert inputs.slot_mapping[:4].tolist() == [17, 21, 27, PAD_SLOT]
    assert inputs.seq_lens[:4].tolist() == [6, 2, 8, 1]
    assert inputs.block_tables[:4].tolist() == [
        [3, 4, 0, 0, 0], [5, 0, 0, 0, 0], [6, 7, 0, 0, 0], [0, 0, 0, 0, 0],
    ]  # fmt: skip
    padded = inputs.context(ctx.kv_cache, 4)  # a valid plan: pad rows read one token
    assert padded.num_seqs == padded.num_paged_seqs == 4 and is_graph_step(padded, 4)
    assert not is_graph_step(ctx, 5)  # more tokens than sequences: a prompt or mixed step


def test_padded_decode_steps_keep_greedy_parity(tmp_path: Path) -> None:
    """The padded static-buffer decode step gives the eager step's greedy tokens (which equal
    transformers' `generate`: test_engine_runner.py); the first prompt is checked against
    transformers here too."""
    checkpoint = build_tiny_model(tmp_path / "llama", "llama", "test", seed=0)
    llm = LLM(str(checkpoint), num_kv_blocks=64, dtype="float32", max_num_seqs=8)
    prompts = [PROMPT, PROMPT[:40], PROMPT[:17]]  # three decodes: bucket 4, one pad row
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    eager = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)]
    runner = llm.engine.runner
    runner.enable_decode_graphs(max_num_seqs=8, capture=False)
    padded = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)]
    graphs = runner.decode_graphs
    assert graphs is not None and graphs.replays >= greedy.max_tokens - 1
    assert padded == eager
    assert padded[0] == hf_greedy(checkpoint, PROMPT, greedy.max_tokens)


def test_decode_graphs_follow_a_moved_kv_cache(tmp_path: Path) -> None:
    """A decode worker moves its cache into registered shared memory after load: the decode
    steps' static plans (and, on a GPU, their captured graphs) must read and write the new
    cache, or decoding attends to the old one (tokens differ from the eager steps)."""
    checkpoint = build_tiny_model(tmp_path / "llama", "llama", "test", seed=0)
    llm = LLM(str(checkpoint), num_kv_blocks=64, dtype="float32", max_num_seqs=8)
    prompts = [PROMPT, PROMPT[:40], PROMPT[:17]]
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    eager = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)]
    runner = llm.engine.runner
    runner.enable_decode_graphs(max_num_seqs=8, capture=False)
    moved = torch.zeros_like(runner.kv_cache.data)
    llm.engine.move_kv_cache(moved, None)
    graphs = runner.decode_graphs
    assert graphs is not None and graphs.cache.data.data_ptr() == moved.data_ptr()
    padded = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)]
    assert graphs.replays >= greedy.max_tokens - 1 and padded == eager
