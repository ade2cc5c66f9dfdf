"""KV write, block copy, gather/scatter and byte packing on the torch path."""

from __future__ import annotations

import random

import pytest
import torch
from dense_reference import random_paged_cache, slots_for
from kvmesh_kernels import (
    KVCacheSpec,
    allocate_kv_cache,
    copy_blocks,
    dequantize,
    gather_blocks,
    packed_from_bytes,
    packed_to_bytes,
    scatter_blocks,
    spec_from_dict,
    spec_to_dict,
    write_kv,
)


def poisoned_cache(spec: KVCacheSpec):  # type: ignore[no-untyped-def]
    cache = allocate_kv_cache(spec)
    if spec.quantized:
        cache.data.view(torch.uint8).random_(0, 256)
        assert cache.scales is not None
        cache.scales.uniform_(0.5, 2.0)
    else:
        cache.data.normal_()
    return cache


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_write_kv_places_tokens_and_skips_minus_one(dtype: torch.dtype, block_size: int) -> None:
    spec = KVCacheSpec(10, 3, block_size, 2, 64, dtype)
    cache = poisoned_cache(spec)
    before = cache.data.clone()
    n = 2 * block_size + 3
    slots = torch.randperm(spec.num_blocks * block_size)[:n]  # [n]
    slots[::4] = -1
    key = torch.randn(n, 2, 64).to(dtype)  # [n, Hkv, D]
    value = torch.randn(n, 2, 64).to(dtype)
    write_kv(cache.layer(1), key, value, slots)
    expected = before.clone()
    for i, s in enumerate(slots.tolist()):
        if s >= 0:
            expected[s // block_size, 1, 0, s % block_size] = key[i]
            expected[s // block_size, 1, 1, s % block_size] = value[i]
    assert torch.equal(cache.data, expected)


@pytest.mark.parametrize("kv_dtype,bound", [("int8", 0.02), ("fp8", 0.05)])
def test_quantized_write_round_trip(kv_dtype: str, bound: float) -> None:
    spec = KVCacheSpec(6, 2, 16, 4, 128, torch.bfloat16, kv_dtype)
    cache = poisoned_cache(spec)
    n = 40
    slots = torch.randperm(spec.num_blocks * 16)[:n]  # [n]
    key = (torch.randn(n, 4, 128) * torch.rand(n, 4, 1) * 10).to(torch.bfloat16)
    value = torch.randn(n, 4, 128).to(torch.bfloat16)  # [n, Hkv, D]
    write_kv(cache.layer(0), key, value, slots)
    layer = cache.layer(0)
    assert layer.scales is not None
    blocks, offsets = slots // 16, slots % 16
    for kv, x in ((0, key), (1, value)):
        stored = layer.data[blocks, kv, offsets]  # [n, Hkv, D]
        back = dequantize(stored, layer.scales[blocks, kv, offsets], torch.float32)
        err = (back - x.float()).norm(dim=-1) / x.float().norm(dim=-1)  # [n, Hkv]
        assert err.max().item() < bound


def test_zero_rows_quantize_to_zero() -> None:
    cache = allocate_kv_cache(KVCacheSpec(2, 1, 8, 1, 64, kv_dtype="int8"))
    zeros = torch.zeros(3, 1, 64)
    write_kv(cache.layer(0), zeros, zeros, torch.tensor([0, 5, 9]))
    assert cache.scales is not None and torch.isfinite(cache.scales).all()
    assert not cache.data.any()


@pytest.mark.parametrize("kv_dtype", ["auto", "int8", "fp8"])
def test_copy_blocks_copies_every_layer_and_scale(kv_dtype: str) -> None:
    spec = KVCacheSpec(12, 3, 8, 2, 64, torch.float16, kv_dtype)
    cache = poisoned_cache(spec)
    before_data, before_scales = cache.data.clone(), cache.scales
    before_scales = None if cache.scales is None else cache.scales.clone()
    pairs = torch.tensor([[1, 7], [4, 2], [1, 9]])  # [N, 2] (src, dst)
    copy_blocks(cache, pairs)
    for src, dst in pairs.tolist():
        assert torch.equal(cache.data[dst].view(torch.uint8), before_data[src].view(torch.uint8))
        if cache.scales is not None and before_scales is not None:
            assert torch.equal(cache.scales[dst], before_scales[src])
    untouched = [b for b in range(12) if b not in (7, 2, 9)]
    assert torch.equal(
        cache.data[untouched].view(torch.uint8), before_data[untouched].view(torch.uint8)
    )


@pytest.mark.parametrize("kv_dtype", ["auto", "int8", "fp8"])
def test_gather_scatter_bytes_round_trip(kv_dtype: str) -> None:
    spec = KVCacheSpec(16, 2, 16, 2, 80, torch.bfloat16, kv_dtype)
    src = poisoned_cache(spec)
    ids = random.sample(range(16), 5)
    packed = gather_blocks(src, ids)
    assert packed.data.shape == (5, 2, 2, 16, 2, 80) and packed.data.is_contiguous()
    raw = packed_to_bytes(packed)
    assert raw.data.dtype == torch.uint8
    total = raw.data.numel() + (0 if raw.scales is None else raw.scales.numel())
    assert total == 5 * spec.bytes_per_block
    wire = (spec_to_dict(raw.spec), raw.num_blocks, raw.data.numpy().tobytes())
    scale_bytes = None if raw.scales is None else raw.scales.numpy().tobytes()
    received = type(raw)(
        spec_from_dict(wire[0]),
        wire[1],
        torch.frombuffer(bytearray(wire[2]), dtype=torch.uint8),
        None
        if scale_bytes is None
        else torch.frombuffer(bytearray(scale_bytes), dtype=torch.uint8),
    )
    dst = poisoned_cache(spec)
    dst_ids = random.sample(range(16), 5)
    scatter_blocks(dst, dst_ids, packed_from_bytes(received))
    for s, d in zip(ids, dst_ids, strict=True):
        assert torch.equal(dst.data[d].view(torch.uint8), src.data[s].view(torch.uint8))
        if src.scales is not None and dst.scales is not None:
            assert torch.equal(dst.scales[d], src.scales[s])


def test_write_then_read_back_through_block_table() -> None:
    pc = random_paged_cache([13, 30], num_kv_heads=2, head_dim=64, block_size=8, num_layers=2)
    for b, n in enumerate([13, 30]):
        row = pc.block_tables[b].tolist()
        slots = slots_for(row, 0, n, 8)
        for layer in range(2):
            data = pc.cache.layer(layer).data  # [num_blocks, 2, 8, Hkv, D]
            assert torch.equal(data[slots // 8, 0, slots % 8], pc.keys[b])
            assert torch.equal(data[slots // 8, 1, slots % 8], pc.values[b])
