"""The attention adapter: the fresh-chunk sdpa path equals attention through the paged cache."""

from __future__ import annotations

import itertools

import pytest
import torch
from kvmesh_kernels import KVCacheSpec, allocate_kv_cache

from kvmesh.engine.attention import ForwardContext, paged_attention_forward

HQ, HKV, D, BS = 8, 2, 32, 4


class _Layer(torch.nn.Module):
    layer_idx = 0


def _context(lens: list[int], starts: list[int], fresh_from: int, kv_dtype: str) -> ForwardContext:
    """Sequence b computes lens[b] tokens from position starts[b]; blocks 8b.. are its own."""
    spec = KVCacheSpec(64, 1, BS, HKV, D, torch.float32, kv_dtype)
    cache = allocate_kv_cache(spec, torch.device("cpu"))
    tables = [[8 * b + i for i in range(8)] for b in range(len(lens))]
    slots = [
        tables[b][p // BS] * BS + p % BS
        for b, (n, s) in enumerate(zip(lens, starts, strict=True))
        for p in range(s, s + n)
    ]
    bounds = [0, *itertools.accumulate(lens)]
    return ForwardContext(
        kv_cache=cache,
        slot_mapping=torch.tensor(slots),
        block_tables=torch.tensor(tables, dtype=torch.int32),
        seq_lens=torch.tensor([s + n for n, s in zip(lens, starts, strict=True)]).int(),
        query_start_loc=torch.tensor(bounds, dtype=torch.int32),
        num_paged_seqs=fresh_from,
        num_paged_tokens=bounds[fresh_from],
        fresh_bounds=tuple(bounds[fresh_from:]) if fresh_from < len(lens) else (),
    )


@pytest.mark.parametrize(("window", "kv_dtype"), [(None, "auto"), (16, "auto"), (None, "int8")])
def test_fresh_path_matches_paged_attention(window: int | None, kv_dtype: str) -> None:
    lens, starts = [1, 1, 5, 12, 7], [9, 3, 6, 0, 0]  # two decodes, one extend, two fresh
    torch.manual_seed(0)
    total = sum(lens)
    q = torch.randn(1, HQ, total, D)
    k = torch.randn(1, HKV, total, D)
    v = torch.randn(1, HKV, total, D)
    history = torch.randn(64, 2, BS, HKV, D)  # context of the decodes and the extend
    outs = []
    for fresh_from in (3, len(lens)):
        ctx = _context(lens, starts, fresh_from, kv_dtype)
        if kv_dtype == "auto":
            ctx.kv_cache.layer(0).data.copy_(history)
        out, _ = paged_attention_forward(
            _Layer(), q, k, v, None, scaling=D**-0.5, sliding_window=window, kvmesh_ctx=ctx
        )
        outs.append(out)
    assert outs[0].shape == (1, total, HQ, D)
    tol = 1e-5 if kv_dtype == "auto" else 0.1
    torch.testing.assert_close(outs[0], outs[1], atol=tol, rtol=tol)


def test_fresh_path_pays_in_16_bit_and_for_long_float32_chunks() -> None:
    """sdpa for every 16-bit first chunk; float32 ones stay on the fused kernel up to the
    measured length, and a step with one longer chunk takes the fresh path."""
    from kvmesh.engine.runner import FLOAT32_FRESH_MIN_TOKENS, fresh_path_pays

    short = (10, 40, 540)
    long = (10, 20, 20 + FLOAT32_FRESH_MIN_TOKENS + 1)
    assert fresh_path_pays(torch.bfloat16, short) and fresh_path_pays(torch.float16, short)
    assert not fresh_path_pays(torch.float32, short)
    assert not fresh_path_pays(torch.float32, (0, FLOAT32_FRESH_MIN_TOKENS))
    assert fresh_path_pays(torch.float32, long)
