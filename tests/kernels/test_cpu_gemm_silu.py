"""kvmesh's GEMM with SiLU-and-mul in its epilogue (`cpu_gemm.gate_up_silu`): bit for bit the
plain GEMM of the same gate|up weight followed by the fused SiLU-and-mul kernel, on every path
this CPU runs, and torch's GEMM and formula to the rounding of the two sums' orders."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from capped_isa import run_capped
from kvmesh_kernels import cpu_fused, cpu_gemm
from test_cpu_gemm import DTYPES


def gate_up(
    intermediate: int, hidden: int, rows: int, dtype: torch.dtype, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    w = (torch.randn(2 * intermediate, hidden, generator=generator) * 0.1).to(dtype)  # [2I, in]
    x = (torch.randn(rows, hidden, generator=generator) * 2).to(dtype)  # [rows, in]
    return w, x


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [0, 1, 11, 12, 13, 200])
@pytest.mark.parametrize("intermediate,hidden", [(16, 32), (48, 64), (1376, 512)])
def test_epilogue_equals_gemm_then_silu_mul(
    rows: int, intermediate: int, hidden: int, dtype: torch.dtype
) -> None:
    w, x = gate_up(intermediate, hidden, rows, dtype, seed=rows + intermediate)
    expected = cpu_fused.silu_mul(cpu_gemm.linear(x, cpu_gemm.pack_weight(w), None))
    got = cpu_gemm.gate_up_silu(x, cpu_gemm.pack_gate_up(w))
    assert got.shape == (rows, intermediate) and got.dtype == dtype
    assert torch.equal(got, expected)
    gate, up = F.linear(x.float(), w.float()).to(dtype).chunk(2, dim=-1)
    # the two GEMMs' sum orders differ: a rounding step of the dtype where a sum cancels
    tolerance = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got, F.silu(gate) * up, atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("dtype", DTYPES)
def test_leading_dims_strided_rows_and_threads(dtype: torch.dtype) -> None:
    w, x = gate_up(64, 96, 30, dtype, seed=7)
    packed = cpu_gemm.pack_gate_up(w)
    wide = torch.zeros(30, 200, dtype=dtype)
    wide[:, 50:146] = x  # rows 200 apart
    expected = cpu_gemm.gate_up_silu(x, packed)
    assert torch.equal(cpu_gemm.gate_up_silu(wide[:, 50:146], packed), expected)
    assert torch.equal(cpu_gemm.gate_up_silu(x.view(5, 6, 96), packed), expected.view(5, 6, 64))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(cpu_gemm.gate_up_silu(x, packed), expected)
    finally:
        torch.set_num_threads(threads)


def test_interleave_order_is_a_permutation_pairing_gate_with_up() -> None:
    for width in (8, 16):
        order = cpu_gemm.gate_up_order(48, width)
        assert sorted(order.tolist()) == list(range(96))
        runs = order.view(-1, 2, width)  # [runs, gate|up, width]
        assert torch.equal(runs[:, 1], runs[:, 0] + 48)  # each up run follows its gate rows


@pytest.mark.skipif(not cpu_gemm.gemm_supported(torch.float32), reason="no float32 GEMM here")
def test_weights_it_does_not_take() -> None:
    assert not cpu_gemm.gate_up_fits(torch.zeros(2 * 24, 64))  # I not a multiple of 16
    assert not cpu_gemm.gate_up_fits(torch.zeros(64, 64, dtype=torch.float16))
    assert cpu_gemm.gate_up_fits(torch.zeros(2 * 32, 64))
    fused = cpu_gemm.pack_gate_up(torch.zeros(64, 64))
    with pytest.raises(ValueError, match="x: last dimension"):
        cpu_gemm.gate_up_silu(torch.zeros(3, 65), fused)
    with pytest.raises(ValueError, match="pack_gate_up"):
        cpu_gemm.gate_up_silu(torch.zeros(3, 64), cpu_gemm.pack_weight(torch.zeros(64, 64)))
    with pytest.raises(ValueError, match="gate_up_silu only"):
        cpu_gemm.linear(torch.zeros(3, 64), fused, None)


AVX2_CHECK = """
import torch
from kvmesh_kernels import cpu_fused, cpu_gemm
assert cpu_gemm.silu_width() == {torch.float32: 8, torch.bfloat16: 0}
g = torch.Generator().manual_seed(3)
w = torch.randn(2 * 80, 72, generator=g) * 0.1
for rows in (1, 6, 7, 50):
    x = torch.randn(rows, 72, generator=g)
    expected = cpu_fused.silu_mul(cpu_gemm.linear(x, cpu_gemm.pack_weight(w), None))
    assert torch.equal(cpu_gemm.gate_up_silu(x, cpu_gemm.pack_gate_up(w)), expected)
print("ok")
"""


@pytest.mark.skipif(not cpu_gemm.gemm_supported(torch.float32), reason="no AVX2 + FMA here")
def test_avx2_path_interleaves_by_eight_and_matches() -> None:
    """Capped at AVX2: the interleave runs are 8 wide (its tile's two vectors of 8 columns), and
    the epilogue still equals the GEMM then SiLU-and-mul on that path."""
    run_capped("avx2", AVX2_CHECK)
