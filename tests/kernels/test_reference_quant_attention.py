"""Attention over int8 / fp8 caches against float64 dense attention on the unquantized K/V."""

from __future__ import annotations

import random

import pytest
import torch
from dense_reference import dense_attention, random_paged_cache, rel_error
from kvmesh_kernels import paged_attention, paged_decode_attention

# Stated bounds on ‖out − ref‖/‖ref‖ over a batch, per-(token, head) scales, by number of
# K outlier channels (x20) of 128. Measured worst cases over 30 draws: 0.010 / 0.072 (int8),
# 0.038 / 0.056 (fp8); see bench/kv_quant_error.py for the scheme comparison.
BOUNDS = {("int8", 0): 2e-2, ("int8", 4): 0.12, ("fp8", 0): 6e-2, ("fp8", 4): 0.10}


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("outliers", [0, 4])
def test_quantized_decode_within_bound(kv_dtype: str, dtype: torch.dtype, outliers: int) -> None:
    lens = [random.randint(20, 120) for _ in range(4)]
    pc = random_paged_cache(
        lens,
        num_kv_heads=2,
        head_dim=128,
        block_size=16,
        dtype=dtype,
        kv_dtype=kv_dtype,
        key_outlier_channels=outliers,
    )
    query = torch.randn(4, 8, 128).to(dtype)  # [batch, Hq, D]
    scale = 128**-0.5
    out = paged_decode_attention(
        query, pc.cache.layer(0), pc.block_tables, pc.seq_lens, scale=scale
    )
    assert out.dtype == dtype
    ref = torch.cat(
        [dense_attention(query[b : b + 1], pc.keys[b], pc.values[b], scale) for b in range(4)]
    )
    assert rel_error(out, ref) < BOUNDS[kv_dtype, outliers]


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8"])
def test_quantized_mixed_batch_with_window(kv_dtype: str) -> None:
    lens = [37, 1, 64, 90]
    q_lens = [37, 1, 1, 11]
    pc = random_paged_cache(lens, num_kv_heads=1, head_dim=64, block_size=8, kv_dtype=kv_dtype)
    starts = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    query = torch.randn(sum(q_lens), 4, 64)  # [tokens, Hq, D]
    out = paged_attention(
        query,
        pc.cache.layer(0),
        pc.block_tables,
        pc.seq_lens,
        starts,
        scale=0.125,
        sliding_window=16,
    )
    refs = []
    for b in range(4):
        lo, hi = int(starts[b]), int(starts[b + 1])
        refs.append(dense_attention(query[lo:hi], pc.keys[b], pc.values[b], 0.125, None, 16))
    assert rel_error(out, torch.cat(refs)) < BOUNDS[kv_dtype, 0]
