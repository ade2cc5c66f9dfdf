"""kvmesh's bfloat16 GEMM on AMX tiles (`cpu_gemm.gemm_path(bfloat16) == "amx"`): torch's
linear to rounding at the shapes where its blocks change (16-row tiles, a last partial block read
from a padded copy, row chunks, partial panels), the SiLU epilogue bit for bit its own GEMM then
SiLU-and-mul, and a cap that keeps bfloat16 on AVX512_BF16. Skipped on CPUs without AMX."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from capped_isa import run_capped
from kvmesh_kernels import cpu_fused, cpu_gemm
from test_cpu_gemm import assert_matches_torch

pytestmark = pytest.mark.skipif(
    cpu_gemm.gemm_path(torch.bfloat16) != "amx", reason="no AMX path of kvmesh's GEMM here"
)


def operands(rows: int, out_features: int, in_features: int, seed: int) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(seed)
    w = torch.randn(out_features, in_features, generator=generator).to(torch.bfloat16)
    x = torch.randn(rows, in_features, generator=generator).to(torch.bfloat16)
    b = torch.randn(out_features, generator=generator)
    return w, x, b


@pytest.mark.parametrize("rows", [0, 1, 15, 16, 17, 31, 32, 33, 47, 100])
@pytest.mark.parametrize("out_features,in_features", [(32, 32), (40, 64), (80, 64), (700, 576)])
def test_tiles_match_torch(rows: int, out_features: int, in_features: int) -> None:
    w, x, b = operands(rows, out_features, in_features, seed=rows + out_features)
    packed = cpu_gemm.pack_weight(w)
    assert_matches_torch(cpu_gemm.linear(x, packed, cpu_gemm.pack_bias(b, packed)), x, w, b)
    assert_matches_torch(cpu_gemm.linear(x, packed, None), x, w, None)


def test_row_chunks_strided_rows_and_threads() -> None:
    """2,048-element rows: a 1 MiB chunk holds 256 of them, so 300 rows run in two chunks, the
    second ending in a partial block; rows 2,100 apart give the same result; so does one thread."""
    w, x, b = operands(300, 96, 2048, seed=3)
    packed = cpu_gemm.pack_weight(w)
    bias = cpu_gemm.pack_bias(b, packed)
    got = cpu_gemm.linear(x, packed, bias)
    assert_matches_torch(got, x, w, b)
    wide = torch.zeros(300, 2100, dtype=torch.bfloat16)
    wide[:, 30:2078] = x
    assert torch.equal(cpu_gemm.linear(wide[:, 30:2078], packed, bias), got)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(cpu_gemm.linear(x, packed, bias), got)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("rows", [1, 16, 17, 40, 300])
def test_silu_epilogue_is_its_gemm_then_silu_mul(rows: int) -> None:
    w, x, _ = operands(rows, 2 * 1536, 576, seed=rows)
    w = w * 0.05
    expected = cpu_fused.silu_mul(cpu_gemm.linear(x, cpu_gemm.pack_weight(w), None))
    assert torch.equal(cpu_gemm.gate_up_silu(x, cpu_gemm.pack_gate_up(w)), expected)


def test_inner_size_not_a_multiple_of_32_takes_avx512bf16_and_matches() -> None:
    """k = 48 cannot fill a tile's 32 k: the library names the AVX512_BF16 path for it (and
    AMX for 32 and 64), the result still matches torch to rounding, and the SiLU epilogue with
    the AMX path's interleave (16) is still its GEMM then SiLU-and-mul bit for bit."""
    paths = {k: cpu_gemm.gemm_path(torch.bfloat16, k) for k in (32, 48, 64)}
    assert paths == {32: "amx", 48: "avx512", 64: "amx"}
    assert cpu_gemm.gemm_path(torch.float32, 48) == cpu_gemm.gemm_path(torch.float32)
    w, x, b = operands(20, 64, 48, seed=9)
    packed = cpu_gemm.pack_weight(w)
    assert_matches_torch(cpu_gemm.linear(x, packed, cpu_gemm.pack_bias(b, packed)), x, w, b)
    expected = cpu_fused.silu_mul(cpu_gemm.linear(x, packed, None))
    assert torch.equal(cpu_gemm.gate_up_silu(x, cpu_gemm.pack_gate_up(w)), expected)


def test_python_threads_at_once_keep_their_own_rows() -> None:
    """Calls from several threads at once (each its own row count, so its own tail block and
    tile work) give what each gives alone."""
    w, x, _ = operands(70, 96, 576, seed=11)
    packed = cpu_gemm.pack_weight(w)
    sizes = [1, 17, 40, 70, 5, 33]
    alone = [cpu_gemm.linear(x[:n], packed, None) for n in sizes]
    with ThreadPoolExecutor(max_workers=len(sizes)) as pool:
        for _ in range(5):
            together = list(pool.map(lambda n: cpu_gemm.linear(x[:n], packed, None), sizes))
            assert all(torch.equal(a, b) for a, b in zip(alone, together, strict=True))


CAPPED_CHECK = """
import torch
from kvmesh_kernels import cpu_gemm
from test_cpu_gemm import assert_matches_torch
assert cpu_gemm.gemm_path(torch.bfloat16) == "avx512", cpu_gemm.gemm_path(torch.bfloat16)
generator = torch.Generator().manual_seed(4)
w = torch.randn(96, 576, generator=generator).to(torch.bfloat16)
x = torch.randn(33, 576, generator=generator).to(torch.bfloat16)
assert_matches_torch(cpu_gemm.linear(x, cpu_gemm.pack_weight(w), None), x, w, None)
print("ok")
"""


def test_a_cap_keeps_bfloat16_on_avx512bf16() -> None:
    run_capped("avx512bf16", CAPPED_CHECK)
