"""kvmesh's AVX512_BF16 GEMM (`kvmesh_kernels.cpu_gemm`) against torch's bfloat16 linear.

Both add exact bfloat16 products into float32 sums and round once; only the order of the
additions differs, so every output is torch's, one bfloat16 step from it, or (where the sum
cancels) within both float32 sums' error bound of it.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from kvmesh_kernels import cpu_gemm

pytestmark = pytest.mark.skipif(
    not cpu_gemm.gemm_supported(), reason="no AVX512_BF16 on this CPU (or no kernel library)"
)


def bf16_step(values: torch.Tensor) -> torch.Tensor:
    """The spacing of bfloat16 numbers at each value's magnitude (float32)."""
    exponent = torch.frexp(values.float().abs().clamp_min(2.0**-120)).exponent
    return torch.ldexp(torch.ones_like(values, dtype=torch.float32), exponent - 8)


def assert_matches_torch(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor, bias) -> None:
    expected = F.linear(x, w, None if bias is None else bias.bfloat16())  # bfloat16
    if bias is not None:  # torch rounds a bfloat16 bias; ours adds the float32 one exactly
        expected = (F.linear(x.float(), w.float()) + bias).bfloat16()
    assert got.shape == expected.shape and got.dtype == torch.bfloat16
    gap = (got.float() - expected.float()).abs()
    terms = x.float().abs() @ w.float().abs().t()  # [rows, out]: what the float32 sums carry
    sum_error = 2 * x.shape[-1] * 2.0**-24 * terms  # both sums' worst case, summed
    assert bool((gap <= bf16_step(expected) + sum_error).all()), float(gap.max())
    if expected.numel() >= 1000:  # a different sum order moves few roundings
        assert float((gap > 0).float().mean()) < 0.05


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [0, 1, 11, 12, 13, 100])
@pytest.mark.parametrize("out_features,in_features", [(1, 2), (33, 48), (80, 578), (700, 64)])
def test_gemm_matches_torch(rows: int, out_features: int, in_features: int, bias: bool) -> None:
    generator = torch.Generator().manual_seed(rows * 1000 + out_features)
    w = torch.randn(out_features, in_features, generator=generator).bfloat16()
    x = torch.randn(rows, in_features, generator=generator).bfloat16()
    b = torch.randn(out_features, generator=generator) if bias else None
    got = cpu_gemm.linear(x, cpu_gemm.pack_weight(w), b)
    assert_matches_torch(got, x, w, b)


def test_many_rows_run_in_chunks_and_keep_every_row() -> None:
    """Rows beyond one L2 chunk (here 84 rows of 1,536) and a partial last tile."""
    generator = torch.Generator().manual_seed(1)
    w = torch.randn(96, 1536, generator=generator).bfloat16()
    x = torch.randn(301, 1536, generator=generator).bfloat16()
    assert_matches_torch(cpu_gemm.linear(x, cpu_gemm.pack_weight(w), None), x, w, None)


def test_strided_rows_and_leading_dims() -> None:
    generator = torch.Generator().manual_seed(2)
    w = torch.randn(40, 32, generator=generator).bfloat16()
    wide = torch.randn(7, 50, generator=generator).bfloat16()
    x = wide[:, 5:37]  # [7, 32], row stride 50
    packed = cpu_gemm.pack_weight(w)
    dense = cpu_gemm.linear(x.contiguous(), packed, None)
    assert torch.equal(cpu_gemm.linear(x, packed, None), dense)
    batch = torch.randn(2, 3, 32, generator=generator).bfloat16()
    got = cpu_gemm.linear(batch, packed, None)  # [2, 3, 40]
    assert got.shape == (2, 3, 40)
    assert torch.equal(got.reshape(6, 40), cpu_gemm.linear(batch.reshape(6, 32), packed, None))


def test_threads_split_columns_not_sums() -> None:
    """Each output is summed by one thread in one order: 1 and 2 threads agree bit for bit."""
    generator = torch.Generator().manual_seed(3)
    w = torch.randn(1000, 256, generator=generator).bfloat16()
    x = torch.randn(40, 256, generator=generator).bfloat16()
    packed = cpu_gemm.pack_weight(w)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = cpu_gemm.linear(x, packed, None)
        torch.set_num_threads(2)
        together = cpu_gemm.linear(x, packed, None)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(alone, together)


def test_weights_it_does_not_take() -> None:
    assert cpu_gemm.weight_fits(torch.zeros(4, 6, dtype=torch.bfloat16))
    assert not cpu_gemm.weight_fits(torch.zeros(4, 5, dtype=torch.bfloat16))  # odd in_features
    assert not cpu_gemm.weight_fits(torch.zeros(4, 6))  # float32
    assert not cpu_gemm.weight_fits(torch.zeros(6, 4, dtype=torch.bfloat16).t())  # strided
    with pytest.raises(AssertionError, match="even inner size"):
        cpu_gemm.pack_weight(torch.zeros(4, 5, dtype=torch.bfloat16))
