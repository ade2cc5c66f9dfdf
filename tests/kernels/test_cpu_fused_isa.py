"""The portable (baseline ISA) path of the fused CPU kernel matches the float64 reference."""

from __future__ import annotations

import pytest
from capped_isa import run_capped
from kvmesh_kernels import cpu_build

CHECK = """
import torch
from dense_reference import dense_attention, random_paged_cache, rel_error
from kvmesh_kernels import cpu_attention
for group, block_size, window in ((4, 16, None), (1, 8, 7), (8, 32, None)):
    lens = [1, 37, 100]
    pc = random_paged_cache(lens, num_kv_heads=2, head_dim=128, block_size=block_size)
    query = torch.randn(3, 2 * group, 128)  # [batch, Hq, D]
    out = cpu_attention.cpu_paged_decode_attention(
        query, pc.cache.layer(0), pc.block_tables, pc.seq_lens, scale=0.1, sliding_window=window
    )
    for b in range(3):
        ref = dense_attention(query[b : b + 1], pc.keys[b], pc.values[b], 0.1, None, window)
        assert rel_error(out[b : b + 1], ref) < 1e-5, (group, block_size, window, b)
print("ok")
"""


def test_baseline_isa_path_matches_dense() -> None:
    if not cpu_build.enabled() or not cpu_build.available():
        pytest.skip("fused CPU kernel unavailable")
    run_capped("baseline", CHECK)


SILU_CHECK = """
import torch
import torch.nn.functional as F
from kvmesh_kernels.cpu_fused import silu_mul
for dtype in (torch.float32, torch.bfloat16):
    gate_up = (torch.randn(67, 2 * 1377, generator=torch.Generator().manual_seed(0)) * 4).to(dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    expected, got = (F.silu(gate) * up).double(), silu_mul(gate_up).double()
    assert bool(((expected - got).abs() <= expected.abs() * 2.0**-20).all()), dtype
print("ok")
"""


@pytest.mark.parametrize("isa", ["baseline", "avx2"])
def test_silu_mul_paths_below_the_best_match_torch(isa: str) -> None:
    """The exp without FMA (baseline) and with AVX2 + FMA: float32 and bfloat16 within 2^-20."""
    if not cpu_build.enabled() or not cpu_build.available():
        pytest.skip("fused CPU kernel unavailable")
    run_capped(isa, SILU_CHECK)
