"""Triton KV write and block copy against the torch reference, bit for bit.

Runs natively on CUDA, or on CPU under TRITON_INTERPRET=1 (set by scripts/test.sh).
"""

from __future__ import annotations

import os

import pytest
import torch
from kvmesh_kernels import KVCacheSpec, PagedKVCache, allocate_kv_cache
from kvmesh_kernels.reference_cache_ops import torch_copy_blocks, torch_write_kv

if os.environ.get("TRITON_INTERPRET") == "1":
    DEVICE = torch.device("cpu")
elif torch.cuda.is_available():
    DEVICE = torch.device("cuda")
else:
    pytest.skip("Triton kernels need CUDA or TRITON_INTERPRET=1", allow_module_level=True)
pytest.importorskip("triton")

from kvmesh_kernels.triton_cache_ops import triton_copy_blocks, triton_write_kv


def raw(t: torch.Tensor) -> torch.Tensor:
    """The bytes of a tensor (NaN-safe exact comparison), on the CPU."""
    return t.contiguous().view(torch.uint8).cpu()


def poisoned_cache(spec: KVCacheSpec) -> PagedKVCache:
    """A cache full of garbage: NaN for float storage, random bytes for int8/fp8 + NaN scales."""
    cache = allocate_kv_cache(spec, DEVICE)
    if spec.quantized:
        raw_data = torch.randint(0, 256, spec.data_shape, dtype=torch.uint8, device=DEVICE)
        cache.data.view(torch.uint8).copy_(raw_data)
        assert cache.scales is not None
        cache.scales.fill_(float("nan"))
    else:
        cache.data.fill_(float("nan"))
    return cache


def clone(cache: PagedKVCache) -> PagedKVCache:
    scales = None if cache.scales is None else cache.scales.clone()
    return PagedKVCache(cache.spec, cache.data.clone(), scales)


@pytest.mark.parametrize(
    ("kv_dtype", "dtype", "head_dim", "num_kv_heads"),
    [
        ("auto", torch.float32, 80, 2),
        ("auto", torch.bfloat16, 64, 3),
        ("int8", torch.float32, 64, 2),
        ("fp8", torch.bfloat16, 80, 1),
    ],
)
def test_write_kv_matches_reference(
    kv_dtype: str, dtype: torch.dtype, head_dim: int, num_kv_heads: int
) -> None:
    spec = KVCacheSpec(6, 2, 8, num_kv_heads, head_dim, dtype, kv_dtype)
    ours = poisoned_cache(spec)
    ref = clone(ours)
    num_tokens = 13
    slots = torch.randperm(spec.num_blocks * spec.block_size)[:num_tokens]  # [tokens] distinct
    slots[[2, 7]] = -1  # skipped tokens
    key = (torch.randn(num_tokens, num_kv_heads, head_dim) * 3).to(dtype)  # [tokens, Hkv, D]
    value = torch.randn(num_tokens, num_kv_heads, head_dim).to(dtype)
    key[4, 0] = 0.0  # an all-zero row quantizes with the minimum scale
    triton_write_kv(ours.layer(1), key.to(DEVICE), value.to(DEVICE), slots.to(DEVICE))
    torch_write_kv(ref.layer(1), key, value, slots)
    assert torch.equal(raw(ours.data), raw(ref.data.cpu()))  # layer 0 and skipped slots untouched
    if ours.scales is not None and ref.scales is not None:
        assert torch.equal(raw(ours.scales), raw(ref.scales))
    kept = slots[slots >= 0].to(DEVICE)  # [n]
    written = ours.layer(1).data[kept // spec.block_size, :, kept % spec.block_size]
    assert not written.float().isnan().any()  # [n, 2, Hkv, D] every written row is clean


def test_write_kv_strided_inputs_and_empty_batch() -> None:
    """Key/value views with a non-trivial token stride (a fused qkv buffer) and no tokens."""
    spec = KVCacheSpec(4, 1, 16, 2, 64)
    ours = poisoned_cache(spec)
    ref = clone(ours)
    qkv = torch.randn(9, 3, 2, 64)  # [tokens, (q, k, v), Hkv, D]
    slots = torch.arange(9) * 7 % 64  # [tokens] distinct slots across blocks
    triton_write_kv(ours.layer(0), qkv[:, 1].to(DEVICE), qkv[:, 2].to(DEVICE), slots.to(DEVICE))
    torch_write_kv(ref.layer(0), qkv[:, 1], qkv[:, 2], slots)
    assert torch.equal(raw(ours.data), raw(ref.data))
    empty = torch.empty(0, 2, 64, device=DEVICE)
    triton_write_kv(ours.layer(0), empty, empty, torch.empty(0, dtype=torch.int64, device=DEVICE))
    assert torch.equal(raw(ours.data), raw(ref.data))


@pytest.mark.parametrize("kv_dtype", ["auto", "int8", "fp8"])
def test_copy_blocks_matches_reference(kv_dtype: str) -> None:
    spec = KVCacheSpec(7, 2, 8, 2, 80, torch.bfloat16, kv_dtype)
    ours = allocate_kv_cache(spec, DEVICE)
    ours.data.view(torch.uint8).copy_(
        torch.randint(0, 256, ours.data.view(torch.uint8).shape, dtype=torch.uint8)
    )
    if ours.scales is not None:
        ours.scales.copy_(torch.rand(spec.scales_shape))
    ref = clone(ours)
    pairs = torch.tensor([[0, 5], [3, 6], [0, 2]])  # [N, (src, dst)]; one source copied twice
    triton_copy_blocks(ours, pairs.to(DEVICE))
    torch_copy_blocks(ref, pairs)
    assert torch.equal(raw(ours.data), raw(ref.data))
    assert torch.equal(raw(ours.data[5]), raw(ours.data[0]))
    if ours.scales is not None and ref.scales is not None:
        assert torch.equal(raw(ours.scales), raw(ref.scales))
    triton_copy_blocks(ours, torch.empty(0, 2, dtype=torch.int64))
    assert torch.equal(raw(ours.data), raw(ref.data))
