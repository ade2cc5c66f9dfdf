"""kvmesh's CPU GEMM (`kvmesh_kernels.cpu_gemm`) against torch's linear, bfloat16 and float32.

Both sum the same products in float32 (bfloat16 products are exact) and round once; only the
order of the additions differs, so every output is torch's, within one rounding step of it,
or (where the sum cancels) within both float32 sums' error bound of it.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from capped_isa import run_capped
from kvmesh_kernels import cpu_gemm

DTYPES = [
    pytest.param(
        dtype,
        marks=pytest.mark.skipif(
            not cpu_gemm.gemm_supported(dtype), reason=f"no {dtype} GEMM of kvmesh's on this CPU"
        ),
    )
    for dtype in (torch.bfloat16, torch.float32)
]


def rounding_step(values: torch.Tensor) -> torch.Tensor:
    """The spacing of numbers of values' dtype at each value's magnitude (float32)."""
    bits = 8 if values.dtype == torch.bfloat16 else 24
    exponent = torch.frexp(values.float().abs().clamp_min(2.0**-120)).exponent
    return torch.ldexp(torch.ones_like(values, dtype=torch.float32), exponent - bits)


def assert_matches_torch(
    got: torch.Tensor, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None
) -> None:
    # the float32 bias added to float32 sums, rounded once (torch would round a bfloat16 bias)
    expected = (F.linear(x.float(), w.float()) + (0 if bias is None else bias)).to(x.dtype)
    assert got.shape == expected.shape and got.dtype == x.dtype
    gap = (got.float() - expected.float()).abs()
    terms = x.float().abs() @ w.float().abs().t()  # [rows, out]: what the float32 sums carry
    sum_error = 2 * x.shape[-1] * 2.0**-24 * terms  # both sums' worst case, summed
    assert bool((gap <= rounding_step(expected) + sum_error).all()), float(gap.max())
    if x.dtype == torch.bfloat16 and expected.numel() >= 1000:  # few roundings move
        assert float((gap > 0).float().mean()) < 0.05


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [0, 1, 11, 12, 13, 100])
@pytest.mark.parametrize("out_features,in_features", [(1, 2), (33, 48), (80, 578), (700, 64)])
def test_gemm_matches_torch(
    rows: int, out_features: int, in_features: int, bias: bool, dtype: torch.dtype
) -> None:
    generator = torch.Generator().manual_seed(rows * 1000 + out_features)
    w = torch.randn(out_features, in_features, generator=generator).to(dtype)
    x = torch.randn(rows, in_features, generator=generator).to(dtype)
    b = torch.randn(out_features, generator=generator) if bias else None
    packed = cpu_gemm.pack_weight(w)
    got = cpu_gemm.linear(x, packed, None if b is None else cpu_gemm.pack_bias(b, packed))
    assert_matches_torch(got, x, w, b)


@pytest.mark.parametrize("dtype", DTYPES)
def test_many_rows_run_in_chunks_and_keep_every_row(dtype: torch.dtype) -> None:
    """Rows beyond one L2 chunk (84 bfloat16 or 36 float32 rows of 1,536), a partial tile."""
    generator = torch.Generator().manual_seed(1)
    w = torch.randn(96, 1536, generator=generator).to(dtype)
    x = torch.randn(301, 1536, generator=generator).to(dtype)
    assert_matches_torch(cpu_gemm.linear(x, cpu_gemm.pack_weight(w), None), x, w, None)


@pytest.mark.skipif(not cpu_gemm.gemm_supported(torch.float32), reason="no float32 path here")
@pytest.mark.parametrize("out_features,in_features", [(45, 77), (3, 1)])
def test_float32_takes_any_inner_size(out_features: int, in_features: int) -> None:
    generator = torch.Generator().manual_seed(4)
    w = torch.randn(out_features, in_features, generator=generator)
    x = torch.randn(14, in_features, generator=generator)
    assert_matches_torch(cpu_gemm.linear(x, cpu_gemm.pack_weight(w), None), x, w, None)


@pytest.mark.parametrize("dtype", DTYPES)
def test_weight_rows_strided_and_prefetch_off(dtype: torch.dtype) -> None:
    """A weight that is a column slice of a wider one packs like its copy; turning the
    prefetch off (a benchmark switch) changes no bit."""
    generator = torch.Generator().manual_seed(6)
    wide = torch.randn(70, 100, generator=generator).to(dtype)
    sliced, dense = cpu_gemm.pack_weight(wide[:, :64]), cpu_gemm.pack_weight(wide[:, :64].clone())
    x = torch.randn(25, 64, generator=generator).to(dtype)
    expected = cpu_gemm.linear(x, dense, None)
    assert torch.equal(cpu_gemm.linear(x, sliced, None), expected)
    assert torch.equal(cpu_gemm.linear(x, dense, None, prefetch=False), expected)
    assert_matches_torch(expected, x, wide[:, :64], None)


@pytest.mark.parametrize("dtype", DTYPES)
def test_nan_and_inf_propagate(dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(7)
    w = torch.randn(40, 32, generator=generator).to(dtype)
    x = torch.randn(3, 32, generator=generator).to(dtype)
    x[0, 5], x[1, 7] = float("nan"), float("inf")
    got = cpu_gemm.linear(x, cpu_gemm.pack_weight(w), None).float()
    expected = F.linear(x.float(), w.float())
    assert bool(got[0].isnan().all()) and bool(expected[0].isnan().all())
    assert torch.equal(got[1].isinf(), expected[1].isinf()) and bool(got[1].isinf().all())
    assert bool(got[2].isfinite().all())


@pytest.mark.parametrize("dtype", DTYPES)
def test_strided_rows_and_leading_dims(dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(2)
    w = torch.randn(40, 32, generator=generator).to(dtype)
    wide = torch.randn(7, 50, generator=generator).to(dtype)
    x = wide[:, 5:37]  # [7, 32], row stride 50
    packed = cpu_gemm.pack_weight(w)
    dense = cpu_gemm.linear(x.contiguous(), packed, None)
    assert torch.equal(cpu_gemm.linear(x, packed, None), dense)
    batch = torch.randn(2, 3, 32, generator=generator).to(dtype)
    got = cpu_gemm.linear(batch, packed, None)  # [2, 3, 40]
    assert got.shape == (2, 3, 40)
    assert torch.equal(got.reshape(6, 40), cpu_gemm.linear(batch.reshape(6, 32), packed, None))


def on_threads(counts: tuple[int, ...], x: torch.Tensor, packed: cpu_gemm.PackedWeight) -> list:
    """linear(x, packed) once per thread count in `counts` (torch's count restored after)."""
    threads = torch.get_num_threads()
    try:
        results = []
        for count in counts:
            torch.set_num_threads(count)
            results.append(cpu_gemm.linear(x, packed, None))
        return results
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("dtype", DTYPES)
def test_threads_split_columns_not_sums(dtype: torch.dtype) -> None:
    """Each output is summed by one thread in one order: 1 and 2 threads agree bit for bit."""
    generator = torch.Generator().manual_seed(3)
    w = torch.randn(1000, 256, generator=generator).to(dtype)
    x = torch.randn(40, 256, generator=generator).to(dtype)
    alone, together = on_threads((1, 2), x, cpu_gemm.pack_weight(w))
    assert torch.equal(alone, together)


def test_weights_it_does_not_take() -> None:
    assert cpu_gemm.weight_fits(torch.zeros(4, 6, dtype=torch.bfloat16))
    assert cpu_gemm.weight_fits(torch.zeros(4, 5))  # float32 takes any inner size
    assert not cpu_gemm.weight_fits(torch.zeros(4, 5, dtype=torch.bfloat16))  # odd in_features
    assert not cpu_gemm.weight_fits(torch.zeros(4, 6, dtype=torch.float16))
    assert not cpu_gemm.weight_fits(torch.zeros(6, 4, dtype=torch.bfloat16).t())  # strided
    with pytest.raises(AssertionError, match="even inner size"):
        cpu_gemm.pack_weight(torch.zeros(4, 5, dtype=torch.bfloat16))


@pytest.mark.parametrize("dtype", DTYPES)
def test_operands_it_cannot_take_raise_and_odd_layouts_are_copied(dtype: torch.dtype) -> None:
    """Wrong dtype, width or bias: ValueError before the kernel runs (no assert, so `python
    -O` keeps it). Strided columns and an expanded row are copied first."""
    generator = torch.Generator().manual_seed(8)
    w = torch.randn(40, 32, generator=generator).to(dtype)
    packed = cpu_gemm.pack_weight(w)
    other = torch.float32 if dtype == torch.bfloat16 else torch.bfloat16
    bias = cpu_gemm.pack_bias(torch.randn(40, generator=generator), packed)  # [64]
    bad = {
        "x": torch.zeros(2, 32, dtype=other),
        "last dimension": torch.zeros(2, 30, dtype=dtype),
    }
    for field, x in bad.items():
        with pytest.raises(ValueError, match=field):
            cpu_gemm.linear(x, packed, None)
    x = torch.randn(2, 32, generator=generator).to(dtype)
    for b in (bias[:40], bias.double(), torch.zeros(128)[::2]):
        with pytest.raises(ValueError, match="bias"):
            cpu_gemm.linear(x, packed, b)
    wide = torch.randn(5, 64, generator=generator).to(dtype)
    columns = wide[:, ::2]  # [5, 32], column stride 2
    assert torch.equal(
        cpu_gemm.linear(columns, packed, bias), cpu_gemm.linear(columns.contiguous(), packed, bias)
    )
    row = x[:1].expand(4, 32)  # row stride 0
    assert torch.equal(
        cpu_gemm.linear(row, packed, None), cpu_gemm.linear(row.contiguous(), packed, None)
    )


@pytest.mark.parametrize("dtype", DTYPES)
def test_more_threads_than_panels(dtype: torch.dtype) -> None:
    """33 outputs are two panels: a team of four runs as two, and agrees with one thread."""
    generator = torch.Generator().manual_seed(9)
    w = torch.randn(33, 64, generator=generator).to(dtype)
    x = torch.randn(300, 64, generator=generator).to(dtype)  # enough work to go parallel
    many, one = on_threads((4, 1), x, cpu_gemm.pack_weight(w))
    assert torch.equal(many, one)
    assert_matches_torch(many, x, w, None)


AVX2_CHECK = """
import torch
from kvmesh_kernels import cpu_gemm
from test_cpu_gemm import assert_matches_torch
assert cpu_gemm.gemm_supported(torch.float32) and not cpu_gemm.gemm_supported(torch.bfloat16)
generator = torch.Generator().manual_seed(5)
for rows, out_features, in_features in ((1, 33, 48), (7, 80, 77), (13, 700, 64), (200, 96, 1536)):
    w = torch.randn(out_features, in_features, generator=generator)
    x = torch.randn(rows, in_features, generator=generator)
    b = torch.randn(out_features, generator=generator)
    packed = cpu_gemm.pack_weight(w)
    assert_matches_torch(cpu_gemm.linear(x, packed, cpu_gemm.pack_bias(b, packed)), x, w, b)
print("ok")
"""


@pytest.mark.skipif(not cpu_gemm.gemm_supported(torch.float32), reason="no AVX2 + FMA here")
def test_avx2_path_matches_torch_and_drops_bfloat16() -> None:
    """Capped at AVX2 (`KVMESH_CPU_KERNEL_ISA=avx2`, as on an AVX2-only CPU): float32 runs the
    6-row, two-half tiles and matches torch; bfloat16 reports no path (AVX512_BF16 only)."""
    run_capped("avx2", AVX2_CHECK)
