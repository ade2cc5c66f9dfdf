"""Triton paged attention (decode with split-K, prefill/extend) against float64 dense attention.

Runs natively on CUDA, or on CPU under TRITON_INTERPRET=1 (set by scripts/test.sh); shapes are
tiny because the interpreter is slow. Caches come from `random_paged_cache`: shuffled block
tables, garbage in unused blocks, ragged lengths.
"""

from __future__ import annotations

import os
import random

import pytest
import torch
from dense_reference import RandomPagedCache, dense_attention, random_paged_cache, rel_error
from kvmesh_kernels import PagedKVCache, paged_attention, set_backend
from kvmesh_kernels.reference_attention import (
    torch_paged_decode_attention,
    torch_paged_prefill_attention,
)

if os.environ.get("TRITON_INTERPRET") == "1":
    DEVICE = torch.device("cpu")
elif torch.cuda.is_available():
    DEVICE = torch.device("cuda")
else:
    pytest.skip("Triton kernels need CUDA or TRITON_INTERPRET=1", allow_module_level=True)
pytest.importorskip("triton")

from kvmesh_kernels.triton_attention import (
    triton_paged_decode_attention,
    triton_paged_prefill_attention,
)

TOL = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 1e-2}
# Quantized caches against dense attention on the unquantized K/V (per-token-per-head scales,
# K with outlier channels, contexts of 1-37 keys): measured worst over 30 seeds about 5e-2.
QUANT_BOUND = {"int8": 8e-2, "fp8": 8e-2}


def on_device(cache: PagedKVCache) -> PagedKVCache:
    scales = None if cache.scales is None else cache.scales.to(DEVICE)
    return PagedKVCache(cache.spec, cache.data.to(DEVICE), scales)


def poisoned(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return torch.full(shape, float("nan"), dtype=dtype, device=DEVICE)


def decode(
    pc: RandomPagedCache,
    query: torch.Tensor,
    window: int | None = None,
    num_splits: int | None = None,
) -> torch.Tensor:
    """Triton decode into a NaN-poisoned buffer; returns it on the CPU."""
    out = poisoned(tuple(query.shape), query.dtype)
    res = triton_paged_decode_attention(
        query.to(DEVICE),
        on_device(pc.cache).layer(0),
        pc.block_tables.to(DEVICE),
        pc.seq_lens.to(DEVICE),
        scale=query.shape[-1] ** -0.5,
        sliding_window=window,
        num_splits=num_splits,
        out=out,
    )
    assert res is out
    return out.cpu()


def prefill(
    pc: RandomPagedCache, query: torch.Tensor, starts: torch.Tensor, window: int | None = None
) -> torch.Tensor:
    """Triton prefill into a NaN-poisoned buffer; returns it on the CPU."""
    out = poisoned(tuple(query.shape), query.dtype)
    triton_paged_prefill_attention(
        query.to(DEVICE),
        on_device(pc.cache).layer(0),
        pc.block_tables.to(DEVICE),
        pc.seq_lens.to(DEVICE),
        starts.to(DEVICE),
        scale=query.shape[-1] ** -0.5,
        sliding_window=window,
        out=out,
    )
    return out.cpu()


def cumulative(q_lens: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)


@pytest.mark.parametrize(
    ("group", "block_size", "head_dim", "window", "num_splits"),
    [
        (1, 8, 64, None, 1),  # MHA, no split-K
        (4, 16, 80, None, 3),  # GQA 4, padded head dim, split-K
        (4, 8, 64, 7, 2),  # sliding window with split-K
        (1, 16, 80, 5, None),  # heuristic split count
    ],
)
def test_decode_matches_dense(
    group: int, block_size: int, head_dim: int, window: int | None, num_splits: int | None
) -> None:
    hkv = 2
    lens = [random.randint(block_size + 1, 3 * block_size - 1), 1, 0]
    random.shuffle(lens)
    pc = random_paged_cache(lens, num_kv_heads=hkv, head_dim=head_dim, block_size=block_size)
    query = torch.randn(len(lens), hkv * group, head_dim)  # [batch, Hq, D]
    out = decode(pc, query, window, num_splits)
    scale = head_dim**-0.5
    for b, n in enumerate(lens):
        ref = dense_attention(query[b : b + 1], pc.keys[b], pc.values[b], scale, None, window)
        assert rel_error(out[b : b + 1], ref) < TOL[torch.float32], (b, n)
    assert torch.count_nonzero(out[lens.index(0)]) == 0  # empty context -> zeros


@pytest.mark.parametrize(
    ("group", "block_size", "head_dim", "window"),
    [(1, 8, 64, None), (4, 16, 80, 6)],
)
def test_prefill_matches_dense(
    group: int, block_size: int, head_dim: int, window: int | None
) -> None:
    hkv = 2
    # A full prefill longer than one query tile, an extend chunk, a decode row, an idle sequence
    # (context but no query rows) and an empty one.
    lens = [20, 2 * block_size + 3, random.randint(2, 3 * block_size), 9, 0]
    q_lens = [20, 5, 1, 0, 0]
    pc = random_paged_cache(lens, num_kv_heads=hkv, head_dim=head_dim, block_size=block_size)
    starts = cumulative(q_lens)
    query = torch.randn(sum(q_lens), hkv * group, head_dim)  # [tokens, Hq, D]
    out = prefill(pc, query, starts, window)
    scale = head_dim**-0.5
    for b in range(len(lens)):
        lo, hi = int(starts[b]), int(starts[b + 1])
        ref = dense_attention(query[lo:hi], pc.keys[b], pc.values[b], scale, None, window)
        assert rel_error(out[lo:hi], ref) < TOL[torch.float32], b


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8"])
def test_quantized_dequantize_fused(kv_dtype: str) -> None:
    """Fused dequantization equals the dequantize-first reference, within the stated bound of
    dense attention on the unquantized K/V."""
    lens = [37, 1, 20]
    q_lens = [37, 1, 4]
    pc = random_paged_cache(
        lens, num_kv_heads=1, head_dim=64, block_size=8, kv_dtype=kv_dtype, key_outlier_channels=2
    )
    starts = cumulative(q_lens)
    query = torch.randn(sum(q_lens), 4, 64)  # [tokens, Hq, D]
    scale = 64**-0.5
    layer = pc.cache.layer(0)
    out = prefill(pc, query, starts, window=16)
    ref = torch_paged_prefill_attention(
        query, layer, pc.block_tables, pc.seq_lens, starts, scale=scale, sliding_window=16
    )
    assert rel_error(out, ref) < 1e-5
    for b in range(len(lens)):
        lo, hi = int(starts[b]), int(starts[b + 1])
        dense = dense_attention(query[lo:hi], pc.keys[b], pc.values[b], scale, None, 16)
        assert rel_error(out[lo:hi], dense) < QUANT_BOUND[kv_dtype]
    last = query[starts[1:] - 1]  # [batch, Hq, D] the last token of each chunk
    out = decode(pc, last, num_splits=2)
    ref = torch_paged_decode_attention(last, layer, pc.block_tables, pc.seq_lens, scale=scale)
    assert rel_error(out, ref) < 1e-5


def test_int64_block_offsets() -> None:
    """A block whose first element lies past 2^31 is read and written at the right place."""
    from kvmesh_kernels import KVCacheSpec
    from kvmesh_kernels.triton_cache_ops import triton_write_kv

    spec = KVCacheSpec((1 << 31) // 2048 + 2, 1, 16, 1, 64, kv_dtype="int8")  # 2048 elems/block
    # Uninitialized (untouched pages cost nothing); only the two blocks looked at are zeroed.
    cache = PagedKVCache(
        spec,
        torch.empty(spec.data_shape, dtype=torch.int8, device=DEVICE),
        torch.empty(spec.scales_shape, dtype=torch.float32, device=DEVICE),
    )
    last = spec.num_blocks - 1
    cache.data[last - 1 :].zero_()
    layer = cache.layer(0)
    key = torch.randn(5, 1, 64)  # [tokens, Hkv, D]
    value = torch.randn(5, 1, 64)
    slots = torch.arange(5) + last * 16  # [tokens]
    triton_write_kv(layer, key.to(DEVICE), value.to(DEVICE), slots.to(DEVICE))
    assert torch.count_nonzero(cache.data[last, 0, 0, :5].cpu()) > 0
    assert torch.count_nonzero(cache.data[last - 1].cpu()) == 0
    query = torch.randn(1, 2, 64)  # [batch, Hq, D]
    out = triton_paged_decode_attention(
        query.to(DEVICE),
        layer,
        torch.tensor([[last]], dtype=torch.int32, device=DEVICE),
        torch.tensor([5], dtype=torch.int32, device=DEVICE),
        scale=0.125,
    ).cpu()
    assert rel_error(out, dense_attention(query, key, value, 0.125)) < QUANT_BOUND["int8"]
    del cache, layer


def test_dispatch_mixed_batch_uses_triton() -> None:
    """paged_attention with the triton backend: decode-only batches go to the decode kernel,
    mixed batches to the prefill kernel; both match dense attention."""
    lens, q_lens = [11, 30, 1], [1, 6, 1]
    pc = random_paged_cache(lens, num_kv_heads=1, head_dim=64, block_size=16)
    cache = on_device(pc.cache)
    scale = 0.125
    set_backend("triton")
    try:
        for qls in ([1, 1, 1], q_lens):
            starts = cumulative(qls)
            query = torch.randn(sum(qls), 4, 64)  # [tokens, Hq, D]
            out = paged_attention(
                query.to(DEVICE),
                cache.layer(0),
                pc.block_tables.to(DEVICE),
                pc.seq_lens.to(DEVICE),
                starts.to(DEVICE),
                scale=scale,
            ).cpu()
            for b in range(len(lens)):
                lo, hi = int(starts[b]), int(starts[b + 1])
                ref = dense_attention(query[lo:hi], pc.keys[b], pc.values[b], scale)
                assert rel_error(out[lo:hi], ref) < TOL[torch.float32]
    finally:
        set_backend(None)


# Every head dim on a GPU; two small cases under the interpreter.
HALF_CASES = (
    [(dt, d) for dt in (torch.float16, torch.bfloat16) for d in (64, 80, 96, 128, 256)]
    if DEVICE.type == "cuda"
    else [(torch.bfloat16, 64), (torch.float16, 80)]
)


@pytest.mark.parametrize(("dtype", "head_dim"), HALF_CASES)
def test_half_precision(dtype: torch.dtype, head_dim: int) -> None:
    """bf16/fp16 caches and queries, GQA 8, sliding window, split-K on and off."""
    high = 700 if DEVICE.type == "cuda" else 40
    lens = [random.randint(high // 2, high) for _ in range(3)]
    q_lens = [lens[0], 7, 1]
    pc = random_paged_cache(lens, num_kv_heads=2, head_dim=head_dim, block_size=16, dtype=dtype)
    starts = cumulative(q_lens)
    query = torch.randn(sum(q_lens), 16, head_dim).to(dtype)  # [tokens, Hq, D] GQA 8
    scale = head_dim**-0.5
    window = high // 4
    out = prefill(pc, query, starts, window=window)
    for b in range(len(lens)):
        lo, hi = int(starts[b]), int(starts[b + 1])
        ref = dense_attention(query[lo:hi], pc.keys[b], pc.values[b], scale, None, window)
        assert rel_error(out[lo:hi], ref) < TOL[dtype]
    last = query[starts[1:] - 1]  # [batch, Hq, D]
    for splits in (1, 4):
        out = decode(pc, last, num_splits=splits)
        for b in range(len(lens)):
            ref = dense_attention(last[b : b + 1], pc.keys[b], pc.values[b], scale)
            assert rel_error(out[b : b + 1], ref) < TOL[dtype]
