"""Torch reference paged attention against float64 dense attention."""

from __future__ import annotations

import random

import pytest
import torch
from dense_reference import dense_attention, random_paged_cache, rel_error
from kvmesh_kernels import paged_attention, paged_decode_attention, paged_prefill_attention
from kvmesh_kernels.reference_attention import key_mask

TOL = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 1e-2}


def ragged_lens(batch: int, block_size: int, high: int) -> list[int]:
    """Context lengths that are mostly not multiples of block_size, with 1 included."""
    lens = [random.randint(2, high) for _ in range(batch - 1)] + [1]
    return [n + 1 if n % block_size == 0 else n for n in lens]


@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("window", [None, 7])
def test_decode_matches_dense(group: int, block_size: int, window: int | None) -> None:
    hkv, head_dim = 2, 64
    lens = ragged_lens(5, block_size, 100)
    pc = random_paged_cache(lens, num_kv_heads=hkv, head_dim=head_dim, block_size=block_size)
    query = torch.randn(len(lens), hkv * group, head_dim)  # [batch, Hq, D]
    scale = head_dim**-0.5
    out = paged_decode_attention(
        query, pc.cache.layer(0), pc.block_tables, pc.seq_lens, scale=scale, sliding_window=window
    )
    assert out.shape == query.shape and out.dtype == query.dtype
    for b in range(len(lens)):
        ref = dense_attention(query[b : b + 1], pc.keys[b], pc.values[b], scale, None, window)
        assert rel_error(out[b : b + 1], ref) < TOL[torch.float32]


@pytest.mark.parametrize("head_dim", [32, 64, 80, 96, 128, 256])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_prefill_head_dims_and_dtypes(head_dim: int, dtype: torch.dtype) -> None:
    hkv, group, block_size = 2, 4, 16
    lens = ragged_lens(3, block_size, 70)
    q_lens = [random.randint(1, n) for n in lens]
    q_lens[0] = lens[0]  # one full prefill
    pc = random_paged_cache(
        lens, num_kv_heads=hkv, head_dim=head_dim, block_size=block_size, dtype=dtype
    )
    starts = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    query = torch.randn(sum(q_lens), hkv * group, head_dim).to(dtype)  # [tokens, Hq, D]
    scale = head_dim**-0.5
    out = paged_prefill_attention(
        query, pc.cache.layer(0), pc.block_tables, pc.seq_lens, starts, scale=scale
    )
    assert out.shape == query.shape and out.dtype == dtype
    for b in range(len(lens)):
        lo, hi = int(starts[b]), int(starts[b + 1])
        ref = dense_attention(query[lo:hi], pc.keys[b], pc.values[b], scale)
        assert rel_error(out[lo:hi], ref) < TOL[dtype]


@pytest.mark.parametrize("window", [None, 1, 5, 40])
@pytest.mark.parametrize("group", [1, 4, 8])
def test_mixed_batch_matches_dense(window: int | None, group: int) -> None:
    hkv, head_dim, block_size = 1, 128, 8
    lens = ragged_lens(6, block_size, 90)
    q_lens = [1 if b % 2 else random.randint(2, max(2, n)) for b, n in enumerate(lens)]
    q_lens = [min(q, n) for q, n in zip(q_lens, lens, strict=True)]
    pc = random_paged_cache(lens, num_kv_heads=hkv, head_dim=head_dim, block_size=block_size)
    starts = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    query = torch.randn(sum(q_lens), hkv * group, head_dim)  # [tokens, Hq, D]
    scale = 0.3
    out = paged_attention(
        query,
        pc.cache.layer(0),
        pc.block_tables,
        pc.seq_lens,
        starts,
        scale=scale,
        sliding_window=window,
    )
    for b in range(len(lens)):
        lo, hi = int(starts[b]), int(starts[b + 1])
        ref = dense_attention(query[lo:hi], pc.keys[b], pc.values[b], scale, None, window)
        assert rel_error(out[lo:hi], ref) < TOL[torch.float32]


def test_empty_context_gives_zeros() -> None:
    pc = random_paged_cache([0, 5, 0], num_kv_heads=2, head_dim=64, block_size=8)
    query = torch.randn(3, 4, 64)  # [batch, Hq, D]
    out = paged_decode_attention(query, pc.cache.layer(0), pc.block_tables, pc.seq_lens, scale=0.1)
    assert torch.equal(out[0], torch.zeros(4, 64)) and torch.equal(out[2], torch.zeros(4, 64))
    ref = dense_attention(query[1:2], pc.keys[1], pc.values[1], 0.1)
    assert rel_error(out[1:2], ref) < 1e-5


@pytest.mark.parametrize("window", [1, 3, 8])
def test_sliding_window_rule_matches_transformers(window: int) -> None:
    masking_utils = pytest.importorskip("transformers.masking_utils")
    fn = masking_utils.sliding_window_causal_mask_function(window)
    pos = torch.arange(20)
    zero = torch.tensor(0)
    theirs = fn(zero, zero, pos.view(-1, 1), pos.view(1, -1))  # [20, 20] bool
    ours = key_mask(pos.view(-1, 1), pos.view(1, -1), window)  # [20, 20]
    assert torch.equal(ours, theirs)


def test_the_reference_runs_in_and_out_of_inference_mode_in_turn() -> None:
    """Its reused gather buffer is kept per inference mode: one made under
    `torch.inference_mode` (an engine step) cannot be written by a call outside it."""
    from kvmesh_kernels.reference_attention import torch_paged_decode_attention

    lens = [20, 33]
    pc = random_paged_cache(lens, num_kv_heads=2, head_dim=64, block_size=16)
    query = torch.randn(len(lens), 4, 64)  # [batch, Hq, D]
    scale = 64**-0.5

    def attend() -> torch.Tensor:
        layer = pc.cache.layer(0)
        return torch_paged_decode_attention(query, layer, pc.block_tables, pc.seq_lens, scale=scale)

    with torch.inference_mode():
        inside = attend().clone()
    assert torch.equal(attend(), inside)
