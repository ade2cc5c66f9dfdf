"""C write_kv (csrc/cpu_cache_ops.cpp) against the torch reference, bit for bit: the copy into
unquantized caches and the per-row quantization into int8 / fp8 caches."""

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
    """Same-dtype unquantized writes and quantized writes take the C path; other dtype pairs
    and the "reference" backend stay on torch, with the same results."""
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
    dispatch.write_kv(quant.layer(0), key, key, slots)  # quantized in C
    assert calls == [1, 1]
    calls.pop()
    kvmesh_kernels.set_backend("reference")
    dispatch.write_kv(cache.layer(0), key, key, slots)
    assert calls == [1]
    with pytest.raises(ValueError, match="slot_mapping must lie in"):
        kvmesh_kernels.set_backend("torch")
        dispatch.write_kv(cache.layer(0), key, key, torch.tensor([0, 1, 2, 3, 32]))


def quantized_pair(spec: KVCacheSpec) -> tuple[PagedKVCache, PagedKVCache]:
    """Two equal caches of garbage bytes (values and scales), for the C and torch writes."""
    cache_c = cache_with_garbage(spec)
    assert cache_c.scales is not None
    cache_c.scales.view(torch.uint8).random_(0, 256)
    return cache_c, PagedKVCache(spec, cache_c.data.clone(), cache_c.scales.clone())


def assert_same_caches(a: PagedKVCache, b: PagedKVCache) -> None:
    assert a.scales is not None and b.scales is not None
    assert torch.equal(a.data.view(torch.uint8), b.data.view(torch.uint8))
    assert torch.equal(a.scales.view(torch.int32), b.scales.view(torch.int32))


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    ("layout", "n"), [("contiguous", 1), ("transposed", 37), ("transposed", 3000)]
)
def test_c_quantized_write_matches_torch_bitwise(
    kv_dtype: str, dtype: torch.dtype, layout: str, n: int
) -> None:
    """Values and scales: rows of every magnitude (zero rows: the minimum scale), half-way
    cases of int8 rounding, slots -1 skipped, strided key/value."""
    block_size, heads, dim = 16, 2, 64
    spec = KVCacheSpec(-(-n // block_size) + 3, 3, block_size, heads, dim, dtype, kv_dtype)
    cache_c, cache_t = quantized_pair(spec)
    slots = torch.randperm(spec.num_blocks * block_size)[:n]  # [n]
    slots[1::5] = -1
    if layout == "contiguous":
        key, value = torch.randn(n, heads, dim).to(dtype), torch.randn(n, heads, dim).to(dtype)
    else:
        key, value = strided_kv(n, heads, dim, dtype), strided_kv(n, heads, dim, dtype)
    magnitudes = 10.0 ** torch.randint(-6, 4, (n, heads, 1)).to(dtype)
    key, value = key * magnitudes, value * magnitudes
    key[0, 0] = 0.0  # a zero row
    if n > 1:
        key[1, 1] = torch.arange(dim).to(dtype) - 31.5  # amax 31.5: ties at x / scale
    layer_c = cache_c.layer(2)
    assert ops.supports_write(layer_c, key, value)
    ops.cpu_write_kv(layer_c, key, value, slots)
    torch_write_kv(cache_t.layer(2), key, value, slots)
    assert_same_caches(cache_c, cache_t)


def test_c_fp8_rounding_matches_torch_over_the_whole_range() -> None:
    """Rows whose largest magnitude is 448 have scale 1, so x itself is rounded to e4m3fn:
    normal and subnormal values, exact midpoints between codes, signed zeros."""
    codes = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    finite = codes[codes.isfinite()].unique()  # every e4m3fn value, sorted
    midpoints = (finite[1:] + finite[:-1]) / 2
    near = torch.cat(
        [
            midpoints,
            midpoints.nextafter(torch.tensor(1e9)),
            midpoints.nextafter(torch.tensor(-1e9)),
            torch.rand(20000) * 896 - 448,
            torch.rand(4000) * 2**-5,
            finite,
        ]
    )
    dim = 64
    rows = near[: near.numel() // (dim - 1) * (dim - 1)].view(-1, dim - 1)
    x = torch.cat([torch.full((rows.shape[0], 1), 448.0), rows.clamp(-448, 448)], dim=1)
    spec = KVCacheSpec(-(-x.shape[0] // 16), 1, 16, 1, dim, torch.float32, "fp8")
    cache_c, cache_t = quantized_pair(spec)
    kv = x.unsqueeze(1)  # [n, 1, dim]
    slots = torch.arange(x.shape[0])
    ops.cpu_write_kv(cache_c.layer(0), kv, kv, slots)
    torch_write_kv(cache_t.layer(0), kv, kv, slots)
    assert_same_caches(cache_c, cache_t)
