"""Fused CPU paged attention (C++ kernel) against float64 dense attention and the reference."""

from __future__ import annotations

import random
from collections.abc import Iterator

import kvmesh_kernels
import pytest
import torch
from dense_reference import dense_attention, random_paged_cache, rel_error
from kvmesh_kernels import (
    KVCacheSpec,
    allocate_kv_cache,
    cpu_attention,
    cpu_build,
    paged_attention,
    paged_decode_attention,
)
from kvmesh_kernels.reference_attention import (
    torch_paged_attention,
    torch_paged_decode_attention,
)

TOL = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 1e-2}
QUANT_BOUNDS = {"int8": 2e-2, "fp8": 6e-2}


@pytest.fixture(scope="module", autouse=True)
def _kernel() -> Iterator[None]:
    """Build (or load) the library once for the module; skip when it cannot be built."""
    if not cpu_build.enabled():
        pytest.skip("fused CPU kernel disabled by KVMESH_CPU_KERNEL=0")
    if not cpu_build.available():
        pytest.skip("fused CPU kernel unavailable (no C++ compiler or build failed; see log)")
    yield
    kvmesh_kernels.set_backend(None)


def ragged_lens(batch: int, block_size: int, high: int) -> list[int]:
    """Context lengths mostly not multiples of block_size, with 1 included."""
    lens = [random.randint(2, high) for _ in range(batch - 1)] + [1]
    return [n + 1 if n % block_size == 0 else n for n in lens]


def poisoned(shape: tuple[int, ...]) -> torch.Tensor:
    return torch.full(shape, float("nan"), dtype=torch.float32)


def fused_decode(query, layer, tables, lens, scale, window=None, splits=None):  # type: ignore[no-untyped-def]
    out = poisoned(tuple(query.shape))
    return cpu_attention.cpu_paged_decode_attention(
        query, layer, tables, lens, scale=scale, sliding_window=window, num_splits=splits, out=out
    )


def fused_varlen(query, layer, tables, lens, starts, scale, window=None):  # type: ignore[no-untyped-def]
    out = poisoned(tuple(query.shape))
    return cpu_attention.cpu_paged_attention(
        query, layer, tables, lens, starts, scale=scale, sliding_window=window, out=out
    )


def starts_of(q_lens: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)


@pytest.mark.parametrize("group", [1, 3, 4, 8])
@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("window", [None, 7])
def test_decode_matches_dense(group: int, block_size: int, window: int | None) -> None:
    hkv, head_dim = 2, 64
    lens = ragged_lens(5, block_size, 100)
    pc = random_paged_cache(lens, num_kv_heads=hkv, head_dim=head_dim, block_size=block_size)
    query = torch.randn(len(lens), hkv * group, head_dim)  # [batch, Hq, D]
    scale = head_dim**-0.5
    layer = pc.cache.layer(0)
    out = fused_decode(query, layer, pc.block_tables, pc.seq_lens, scale, window)
    assert out.shape == query.shape and out.dtype == query.dtype
    for b in range(len(lens)):
        ref = dense_attention(query[b : b + 1], pc.keys[b], pc.values[b], scale, None, window)
        assert rel_error(out[b : b + 1], ref) < TOL[torch.float32]
    same = torch_paged_decode_attention(
        query, layer, pc.block_tables, pc.seq_lens, scale=scale, sliding_window=window
    )
    torch.testing.assert_close(out, same, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("head_dim", [32, 64, 80, 96, 128, 256])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_head_dims_and_dtypes(head_dim: int, dtype: torch.dtype) -> None:
    hkv, group, block_size = 2, 4, 16
    lens = ragged_lens(3, block_size, 70)
    q_lens = [random.randint(1, n) for n in lens]
    q_lens[0] = lens[0]  # one full prefill
    pc = random_paged_cache(
        lens, num_kv_heads=hkv, head_dim=head_dim, block_size=block_size, dtype=dtype
    )
    starts = starts_of(q_lens)
    query = torch.randn(sum(q_lens), hkv * group, head_dim).to(dtype)  # [tokens, Hq, D]
    scale = head_dim**-0.5
    layer = pc.cache.layer(0)
    out = fused_varlen(query, layer, pc.block_tables, pc.seq_lens, starts, scale)
    assert out.shape == query.shape and out.dtype == dtype
    for b in range(len(lens)):
        lo, hi = int(starts[b]), int(starts[b + 1])
        ref = dense_attention(query[lo:hi], pc.keys[b], pc.values[b], scale)
        assert rel_error(out[lo:hi], ref) < TOL[dtype]
    dec = fused_decode(query[: len(lens)], layer, pc.block_tables, pc.seq_lens, scale)
    for b in range(len(lens)):
        ref = dense_attention(query[b : b + 1], pc.keys[b], pc.values[b], scale)
        assert rel_error(dec[b : b + 1], ref) < TOL[dtype]


@pytest.mark.parametrize("window", [None, 1, 5, 40])
@pytest.mark.parametrize("group", [1, 4, 8])
def test_mixed_batch_matches_dense_and_reference(window: int | None, group: int) -> None:
    hkv, head_dim, block_size = 2, 128, 8
    lens = ragged_lens(6, block_size, 90)
    q_lens = [1 if b % 2 else random.randint(2, max(2, n)) for b, n in enumerate(lens)]
    q_lens = [min(q, n) for q, n in zip(q_lens, lens, strict=True)]
    pc = random_paged_cache(lens, num_kv_heads=hkv, head_dim=head_dim, block_size=block_size)
    starts = starts_of(q_lens)
    query = torch.randn(sum(q_lens), hkv * group, head_dim)  # [tokens, Hq, D]
    layer = pc.cache.layer(0)
    out = fused_varlen(query, layer, pc.block_tables, pc.seq_lens, starts, 0.3, window)
    for b in range(len(lens)):
        lo, hi = int(starts[b]), int(starts[b + 1])
        ref = dense_attention(query[lo:hi], pc.keys[b], pc.values[b], 0.3, None, window)
        assert rel_error(out[lo:hi], ref) < TOL[torch.float32]
    same = torch_paged_attention(
        query, layer, pc.block_tables, pc.seq_lens, starts, scale=0.3, sliding_window=window
    )
    torch.testing.assert_close(out, same, rtol=1e-5, atol=1e-5)


def test_empty_and_single_token_contexts() -> None:
    pc = random_paged_cache([0, 5, 0, 1], num_kv_heads=2, head_dim=64, block_size=8)
    query = torch.randn(4, 4, 64)  # [batch, Hq, D]
    out = fused_decode(query, pc.cache.layer(0), pc.block_tables, pc.seq_lens, 0.1)
    assert torch.equal(out[0], torch.zeros(4, 64)) and torch.equal(out[2], torch.zeros(4, 64))
    for b in (1, 3):
        ref = dense_attention(query[b : b + 1], pc.keys[b], pc.values[b], 0.1)
        assert rel_error(out[b : b + 1], ref) < 1e-5
    # one token sees only itself: the output is its value row, repeated over the group
    expected = pc.values[3][0].view(2, 1, 64).expand(2, 2, 64)  # [Hkv, G, D]
    torch.testing.assert_close(out[3].view(2, 2, 64), expected)


@pytest.mark.parametrize("splits", [2, 3, 7])
@pytest.mark.parametrize("window", [None, 50])
def test_context_splits_match_one_split(splits: int, window: int | None) -> None:
    lens = [333, 1, 70]
    pc = random_paged_cache(lens, num_kv_heads=1, head_dim=64, block_size=16)
    query = torch.randn(3, 8, 64)  # [batch, Hq, D]
    layer = pc.cache.layer(0)
    one = fused_decode(query, layer, pc.block_tables, pc.seq_lens, 0.2, window, 1)
    many = fused_decode(query, layer, pc.block_tables, pc.seq_lens, 0.2, window, splits)
    torch.testing.assert_close(many, one, rtol=1e-5, atol=1e-6)
    for b in range(3):
        ref = dense_attention(query[b : b + 1], pc.keys[b], pc.values[b], 0.2, None, window)
        assert rel_error(many[b : b + 1], ref) < 1e-5


def test_strided_layer_view() -> None:
    """Layer 1 of a two-layer cache: non-contiguous across blocks, read through strides."""
    lens = [45, 17]
    pc = random_paged_cache(lens, num_kv_heads=4, head_dim=96, block_size=8, num_layers=2)
    layer = pc.cache.layer(1)
    assert not layer.data.is_contiguous()
    query = torch.randn(2, 8, 96)  # [batch, Hq, D]
    out = fused_decode(query, layer, pc.block_tables, pc.seq_lens, 0.1, 20)
    for b in range(2):
        ref = dense_attention(query[b : b + 1], pc.keys[b], pc.values[b], 0.1, None, 20)
        assert rel_error(out[b : b + 1], ref) < 1e-5


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantized_cache(kv_dtype: str, dtype: torch.dtype) -> None:
    lens = [random.randint(20, 120) for _ in range(3)] + [1]
    q_lens = [lens[0], 1, 5, 1]
    pc = random_paged_cache(
        lens, num_kv_heads=2, head_dim=128, block_size=16, dtype=dtype, kv_dtype=kv_dtype
    )
    starts = starts_of(q_lens)
    query = torch.randn(sum(q_lens), 8, 128).to(dtype)  # [tokens, Hq, D]
    layer = pc.cache.layer(0)
    out = fused_varlen(query, layer, pc.block_tables, pc.seq_lens, starts, 0.09, 64)
    refs = []
    for b in range(len(lens)):
        lo, hi = int(starts[b]), int(starts[b + 1])
        refs.append(dense_attention(query[lo:hi], pc.keys[b], pc.values[b], 0.09, None, 64))
    assert rel_error(out, torch.cat(refs)) < QUANT_BOUNDS[kv_dtype]
    if dtype == torch.float32:  # same dequantized values as the reference: equal to rounding
        same = torch_paged_attention(
            query, layer, pc.block_tables, pc.seq_lens, starts, scale=0.09, sliding_window=64
        )
        assert rel_error(out, same) < 1e-5


def test_dispatch_uses_fused_kernel_and_reference_backend_stays(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    lens = [40, 9]
    pc = random_paged_cache(lens, num_kv_heads=2, head_dim=64, block_size=8)
    query = torch.randn(2, 4, 64)  # [batch, Hq, D]
    layer = pc.cache.layer(0)
    calls: list[str] = []
    real = cpu_attention.cpu_paged_attention

    def spy(*args, **kwargs):  # type: ignore[no-untyped-def]
        calls.append("fused")
        return real(*args, **kwargs)

    monkeypatch.setattr(cpu_attention, "cpu_paged_attention", spy)
    kvmesh_kernels.set_backend("torch")
    fused = paged_decode_attention(query, layer, pc.block_tables, pc.seq_lens, scale=0.1)
    mixed = paged_attention(
        query, layer, pc.block_tables, pc.seq_lens, starts_of([1, 1]), scale=0.1
    )
    assert calls == ["fused", "fused"]
    kvmesh_kernels.set_backend("reference")
    ref = paged_decode_attention(query, layer, pc.block_tables, pc.seq_lens, scale=0.1)
    assert calls == ["fused", "fused"]
    torch.testing.assert_close(fused, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(mixed, ref, rtol=1e-5, atol=1e-5)


ISAS = ["avx512bf16", "avx512", "avx2", "baseline"]  # caps: a CPU without one runs the next it has


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    ("hkv", "group", "head_dim", "block_size"),
    [(2, 4, 64, 16), (1, 8, 128, 8), (8, 4, 128, 16), (2, 1, 80, 32), (3, 3, 64, 16),
     (1, 7, 96, 16), (2, 1, 128, 16)],
)  # fmt: skip
def test_every_isa_matches_dense(
    isa: str, dtype: torch.dtype, hkv: int, group: int, head_dim: int, block_size: int
) -> None:
    """Decode and extend rows over contexts around the 16/64-key steps of the AVX-512 path,
    with and without a window (8 kv heads x 128 takes shorter steps and, below float32,
    prefetches; groups of 3 and 7 take the three-row P x V tiles, a group of 1 the single-row
    ones, 8 vectors wide at 128; bfloat16 V rows of 80 and 96 take the 32-element unpacked
    tiles beside the 16-element ones)."""
    lens = [1, 15, 16, 17, 63, 64, 65, 130, 200]
    q_lens = [1, 1, 16, 1, 9, 64, 1, 70, 1]
    pc = random_paged_cache(
        lens, num_kv_heads=hkv, head_dim=head_dim, block_size=block_size, dtype=dtype
    )
    starts = starts_of(q_lens)
    query = torch.randn(sum(q_lens), hkv * group, head_dim).to(dtype)  # [tokens, Hq, D]
    layer = pc.cache.layer(0)
    for window in (None, 37):
        out = cpu_attention.cpu_paged_attention(
            query, layer, pc.block_tables, pc.seq_lens, starts, scale=0.11,
            sliding_window=window, isa=isa,
        )  # fmt: skip
        for b in range(len(lens)):
            lo, hi = int(starts[b]), int(starts[b + 1])
            ref = dense_attention(query[lo:hi], pc.keys[b], pc.values[b], 0.11, None, window)
            assert rel_error(out[lo:hi], ref) < TOL[dtype], (isa, window, b)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("kv_dtype", ["int8", "fp8"])
@pytest.mark.parametrize("group", [4, 3])  # 3: fp8 decode converts K into the buffer
def test_every_isa_quantized(isa: str, kv_dtype: str, group: int) -> None:
    lens = [90, 1, 64, 33, 150]
    q_lens = [90, 1, 3, 1, 1]
    pc = random_paged_cache(
        lens, num_kv_heads=2, head_dim=64, block_size=16, dtype=torch.bfloat16, kv_dtype=kv_dtype
    )
    starts = starts_of(q_lens)
    query = torch.randn(sum(q_lens), 2 * group, 64).bfloat16()  # [tokens, Hq, D]
    out = cpu_attention.cpu_paged_attention(
        query, pc.cache.layer(0), pc.block_tables, pc.seq_lens, starts, scale=0.125, isa=isa
    )
    refs = [
        dense_attention(query[int(starts[b]) : int(starts[b + 1])], pc.keys[b], pc.values[b], 0.125)
        for b in range(len(lens))
    ]
    assert rel_error(out, torch.cat(refs)) < QUANT_BOUNDS[kv_dtype]


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("splits", [2, 5])
def test_every_isa_splits(isa: str, splits: int) -> None:
    lens = [333, 1, 70]
    pc = random_paged_cache(lens, num_kv_heads=2, head_dim=64, block_size=16)
    query = torch.randn(3, 8, 64).bfloat16()  # [batch, Hq, D]
    layer = pc.cache.layer(0)
    one = cpu_attention.cpu_paged_decode_attention(
        query, layer, pc.block_tables, pc.seq_lens, scale=0.2, num_splits=1, isa=isa
    )
    many = cpu_attention.cpu_paged_decode_attention(
        query, layer, pc.block_tables, pc.seq_lens, scale=0.2, num_splits=splits, isa=isa
    )
    torch.testing.assert_close(many.float(), one.float(), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_query_read_in_place_and_output_rounding(dtype: torch.dtype) -> None:
    """A strided 16-bit query (the engine's transposed view) is read as it is and the output is
    rounded like torch's `.to(dtype)`: bitwise equal to the float32-in, float32-out call (on
    the float32-score paths: the AVX512_BF16 path sums a bfloat16 query's products in
    another order)."""
    lens = [40, 9, 77]
    q_lens = [1, 9, 5]
    pc = random_paged_cache(lens, num_kv_heads=2, head_dim=64, block_size=16, dtype=dtype)
    starts = starts_of(q_lens)
    tokens = sum(q_lens)
    query = torch.randn(1, 8, tokens, 64).to(dtype)[0].transpose(0, 1)  # [tokens, Hq, D] view
    assert not query.is_contiguous()
    layer = pc.cache.layer(0)
    args = (layer, pc.block_tables, pc.seq_lens, starts)
    direct = cpu_attention.cpu_paged_attention(query, *args, scale=0.125, isa="avx512")
    assert direct.dtype == dtype and direct.shape == query.shape
    via_f32 = cpu_attention.cpu_paged_attention(
        query.float().contiguous(), *args, scale=0.125, isa="avx512"
    )
    assert torch.equal(direct, via_f32.to(dtype))
    into = torch.full((tokens, 8, 64), float("nan"), dtype=dtype)
    cpu_attention.cpu_paged_attention(query, *args, scale=0.125, out=into, isa="avx512")
    assert torch.equal(into, direct)


@pytest.mark.parametrize("isa", ["avx512", "avx2", "baseline"])
def test_fp8_values_read_exactly(isa: str) -> None:
    """A query that sees one key gets that key's V row times its scale: every finite e4m3fn
    code (normal, subnormal, signed zeros) read back exactly, by decode rows (converted as
    they load) and by a 4-token chunk (16 query rows per kv head: through the buffers)."""
    codes = torch.arange(256, dtype=torch.uint8)
    finite = codes[~torch.isnan(codes.view(torch.float8_e4m3fn).float())]  # 254 codes
    rows = torch.cat([finite, finite[:2]]).view(4, 1, 64)  # V of token 0 of blocks 0..3
    spec = KVCacheSpec(4, 1, 16, 1, 64, torch.float32, "fp8")
    cache = allocate_kv_cache(spec)
    assert cache.scales is not None
    cache.data.view(torch.uint8)[:, 0, 1, 0] = rows  # [block, layer, V, token 0]
    cache.scales.fill_(1.0)
    tables = torch.arange(4, dtype=torch.int32).view(4, 1)
    expected = rows.view(torch.float8_e4m3fn).float()  # [4, 1, 64]
    for q_len in (1, 4):  # each sequence's context is its chunk: token 0 sees key 0 only
        lens = torch.full((4,), q_len, dtype=torch.int32)
        starts = torch.arange(0, 4 * q_len + 1, q_len, dtype=torch.int32)
        query = torch.randn(4 * q_len, 4, 64)  # [tokens, Hq, D]
        out = cpu_attention.cpu_paged_attention(
            query, cache.layer(0), tables, lens, starts, scale=0.125, isa=isa
        )
        first = out.view(4, q_len, 4, 64)[:, 0]  # [sequence, Hq, D]
        assert torch.equal(first, expected.expand(4, 4, 64))
