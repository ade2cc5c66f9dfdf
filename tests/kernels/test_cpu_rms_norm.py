"""Fused bfloat16 RMSNorm kernel vs transformers' Llama RMSNorm formula."""

from __future__ import annotations

import pytest
import torch
from kvmesh_kernels.cpu_build import available
from kvmesh_kernels.cpu_norm import rms_norm_bf16, rms_norm_supported

pytestmark = pytest.mark.skipif(not available(), reason="fused CPU library not built")


def transformers_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """LlamaRMSNorm.forward, verbatim."""
    h = x.to(torch.float32)
    variance = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(variance + eps)
    return weight * h.to(x.dtype)


def within_one_rounding(expected: torch.Tensor, got: torch.Tensor) -> bool:
    e, g = expected.float(), got.float()
    return bool(((e - g).abs() <= e.abs() * 2.0**-7).all())


@pytest.mark.parametrize("shape", [(1, 1, 512), (1, 64, 512), (3, 5, 64), (9, 4096), (2048, 128)])
def test_matches_transformers_within_one_rounding(shape: tuple[int, ...]) -> None:
    generator = torch.Generator().manual_seed(sum(shape))
    x = (torch.randn(shape, generator=generator) * 3).to(torch.bfloat16)
    weight = torch.randn(shape[-1], generator=generator).to(torch.bfloat16)
    expected = transformers_rms_norm(x, weight, 1e-6)
    got = rms_norm_bf16(x, weight, 1e-6)
    assert got.shape == expected.shape and got.dtype == torch.bfloat16
    assert within_one_rounding(expected, got)
    assert (expected != got).float().mean().item() < 1e-3  # differences are rare


def test_width_512_rows_are_bit_identical() -> None:
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(1, 64, 512, generator=generator).to(torch.bfloat16)
    weight = torch.randn(512, generator=generator).to(torch.bfloat16)
    assert torch.equal(rms_norm_bf16(x, weight, 1e-5), transformers_rms_norm(x, weight, 1e-5))


def test_strided_rows_and_empty_batch() -> None:
    base = torch.randn(6, 256).to(torch.bfloat16)
    x = base[:, :128]  # [6, 128], row stride 256
    weight = torch.randn(128).to(torch.bfloat16)
    assert rms_norm_supported(x, weight)
    assert within_one_rounding(
        transformers_rms_norm(x, weight, 1e-6), rms_norm_bf16(x, weight, 1e-6)
    )
    empty = torch.empty(0, 128, dtype=torch.bfloat16)
    assert rms_norm_bf16(empty, weight, 1e-6).shape == (0, 128)


def test_zero_row_gives_zeros_and_nan_propagates() -> None:
    x = torch.zeros(2, 64, dtype=torch.bfloat16)
    x[1, 3] = float("nan")
    weight = torch.ones(64, dtype=torch.bfloat16)
    out = rms_norm_bf16(x, weight, 1e-6)
    assert torch.equal(out[0], torch.zeros(64, dtype=torch.bfloat16))
    assert out[1].isnan().all()


def test_unsupported_inputs_are_refused() -> None:
    weight = torch.ones(64, dtype=torch.bfloat16)
    assert not rms_norm_supported(torch.ones(4, 64), weight)  # float32
    assert not rms_norm_supported(torch.ones(4, 32, dtype=torch.bfloat16), weight)  # width
    transposed = torch.ones(64, 4, dtype=torch.bfloat16).t()  # element stride 4
    assert not rms_norm_supported(transposed, weight)
