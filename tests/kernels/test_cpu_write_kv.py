"""C write_kv (csrc/cpu_cache_ops.cpp) against the torch reference, bit for bit."""

from __future__ import annotations

from collections.abc import Iterator

import kvmesh_kernels
import pytest
import torch
from kvmesh_kernels import KVCacheSpec, PagedKVCache, allocate_kv_cache, cpu_build, dispatch
from kvmesh_kernels import cpu_cache_ops as ops
from kvmesh_kernels.reference_cache_ops import torch_write_kv


@pytest.fixture(scope="module", autouse=True)
def _library() -> Iterator[None]:
    if not cpu_build.enabled() or not cpu_build.available():
        pytest.skip("CPU kernel library unavailable")
    yield
    kvmesh_kernels.set_backend(None)


def cache_with_garbage(spec: KVCacheSpec) -> PagedKVCache:
    cache = allocate_kv_cache(spec)
    cache.data.view(torch.uint8).random_(0, 256)  # any bit pattern, NaNs included
    return cache


def strided_kv(n: int, heads: int, dim: int, dtype: torch.dtype) -> torch.Tensor:
    """[n, heads, dim] with the engine's layout: a transpose of [heads, n, dim]."""
    return torch.randn(heads, n, dim).to(dtype).transpose(0, 1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("layout", ["contiguous", "transposed"])
@pytest.mark.parametrize("n", [1, 37, 3000])  # 3000 tokens take the parallel path
def test_c_write_matches_torch_bitwise(dtype: torch.dtype, layout: str, n: int) -> None:
    block_size, heads, dim = 16, 2, 64
    spec = KVCacheSpec(-(-n // block_size) + 3, 3, block_size, heads, dim, dtype)
    cache_c = cache_with_garbage(spec)
    cache_t = PagedKVCache(spec, cache_c.data.clone(), None)
    slots = torch.randperm(spec.num_blocks * block_size)[:n]  # [n]
    slots[1::5] = -1
    if layout == "contiguous":
        key = torch.randn(n, heads, dim).to(dtype)
        value = torch.randn(n, heads, dim).to(dtype)
    else:
        key, value = strided_kv(n, heads, dim, dtype), strided_kv(n, heads, dim, dtype)
    key[0, 0, :3] = torch.tensor([float("nan"), float("inf"), -0.0])
    layer_c = cache_c.layer(1)
    assert ops.supports_write(layer_c, key, value)
    ops.cpu_write_kv(layer_c, key, value, slots)
    torch_write_kv(cache_t.layer(1), key, value, slots)
    assert torch.equal(cache_c.data.view(torch.uint8), cache_t.data.view(torch.uint8))


def test_c_write_rejects_out_of_range_slots_before_writing() -> None:
    spec = KVCacheSpec(4, 2, 8, 2, 64, torch.bfloat16)
    cache = cache_with_garbage(spec)
    before = cache.data.clone()
    key = torch.randn(3, 2, 64).bfloat16()
    for bad in ([0, 1, 32], [0, -2, 3]):
        with pytest.raises(ValueError, match=r"slot_mapping must lie in \[-1, 32\)"):
            ops.cpu_write_kv(cache.layer(0), key, key, torch.tensor(bad))
        assert torch.equal(cache.data.view(torch.uint8), before.view(torch.uint8))


def test_dispatch_routes_cpu_writes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Same-dtype unquantized writes take the C copy; other dtypes, quantized caches and the
    "reference" backend stay on torch, with the same results."""
    calls: list[int] = []
    real = ops.cpu_write_kv

    def spy(*args, **kwargs):  # type: ignore[no-untyped-def]
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(ops, "cpu_write_kv", spy)
    key = torch.randn(5, 2, 64).bfloat16()
    slots = torch.tensor([3, -1, 9, 0, 17])
    kvmesh_kernels.set_backend("torch")
    spec = KVCacheSpec(4, 1, 8, 2, 64, torch.bfloat16)
    cache = cache_with_garbage(spec)
    dispatch.write_kv(cache.layer(0), key, key, slots)
    assert calls == [1]
    dispatch.write_kv(cache.layer(0), key.float(), key.float(), slots)  # converts: torch
    assert calls == [1]
    quant = allocate_kv_cache(KVCacheSpec(4, 1, 8, 2, 64, torch.bfloat16, "int8"))
    dispatch.write_kv(quant.layer(0), key, key, slots)
    assert calls == [1]
    kvmesh_kernels.set_backend("reference")
    dispatch.write_kv(cache.layer(0), key, key, slots)
    assert calls == [1]
    with pytest.raises(ValueError, match="slot_mapping must lie in"):
        kvmesh_kernels.set_backend("torch")
        dispatch.write_kv(cache.layer(0), key, key, torch.tensor([0, 1, 2, 3, 32]))
