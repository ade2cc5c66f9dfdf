"""The native executor's fused CPU ops vs transformers' Llama-family formulas.

bfloat16: every product and sum rounds as torch's does, so results are bitwise equal except
where a float32 sum of squares (norms) runs in another order: within one bf16 rounding there.
float32: within a few ulps (sum order, exp and rsqrt implementations).
"""

from __future__ import annotations

import pytest
import torch
from kvmesh_kernels.cpu_build import available
from kvmesh_kernels.cpu_fused import add_rms_norm, fused_supported, rms_norm, rope_

pytestmark = pytest.mark.skipif(not available(), reason="fused CPU library not built")

DTYPES = (torch.float32, torch.bfloat16)


def hf_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """LlamaRMSNorm.forward, verbatim."""
    h = x.to(torch.float32)
    variance = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(variance + eps)
    return weight * h.to(x.dtype)


def close(expected: torch.Tensor, got: torch.Tensor) -> bool:
    e, g = expected.float(), got.float()
    step = 2.0**-7 if expected.dtype == torch.bfloat16 else 2.0**-20
    return bool(((e - g).abs() <= e.abs() * step + 1e-6).all())


def randn(*shape: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=generator) * 2).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 7, 300])
def test_add_rms_norm_matches_add_then_norm(dtype: torch.dtype, rows: int) -> None:
    x = randn(rows, 2 * 576, dtype=dtype, seed=rows)[:, :576]  # a row-strided view
    residual = randn(rows, 576, dtype=dtype, seed=rows + 1)
    weight = randn(576, dtype=dtype, seed=3)
    total = x + residual
    expected = hf_norm(total, weight, 1e-5)
    assert fused_supported(x, residual, weight)
    got = add_rms_norm(x, residual, weight, 1e-5)
    assert torch.equal(residual, total)  # the residual stream, updated in place
    assert close(expected, got)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_of_strided_rows(dtype: torch.dtype) -> None:
    x = randn(33, 256, dtype=dtype, seed=5)[:, :128]
    weight = randn(128, dtype=dtype, seed=6)
    assert close(hf_norm(x, weight, 1e-6), rms_norm(x, weight, 1e-6))


def hf_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_in_place_on_strided_heads_is_bitwise(dtype: torch.dtype) -> None:
    tokens, heads, dim = 19, 9, 64
    qkv = randn(tokens, (heads + 6) * dim, dtype=dtype, seed=8)
    q = qkv[:, : heads * dim].view(tokens, heads, dim)  # strided rows inside the qkv output
    freqs = torch.outer(torch.arange(100.0), 1.0 / 10000 ** (torch.arange(0, dim, 2) / dim))
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)  # [100, D]
    positions = torch.randint(0, 100, (tokens,), generator=torch.Generator().manual_seed(9))
    expected = hf_rope(q, cos[positions][:, None], sin[positions][:, None])
    rest = qkv[:, heads * dim :].clone()
    rope_(q, cos, sin, positions)
    assert torch.equal(q, expected)
    assert torch.equal(qkv[:, heads * dim :], rest)  # k and v untouched


def test_rope_refuses_a_position_outside_the_table() -> None:
    x = torch.zeros(2, 1, 8)
    table = torch.zeros(4, 8)
    with pytest.raises(RuntimeError, match="code 2"):
        rope_(x, table, table, torch.tensor([0, 4]))


def test_unsupported_inputs_are_reported() -> None:
    assert not fused_supported(torch.zeros(2, 4, dtype=torch.float16))
    assert not fused_supported(torch.zeros(4, 2).t())
