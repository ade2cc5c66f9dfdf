"""KV quantization: one float32 scale per (token, kv head), for K and V alike.

    q = round_or_cast(x / scale),  scale = amax(|x| over head_dim) / QMAX
    x ≈ q * scale

int8 uses QMAX = 127 with round-to-nearest; fp8 e4m3 uses QMAX = 448 and a saturating cast.
Scales are dynamic (computed on write, no calibration). The choice of grouping is measured in
bench/kv_quant_error.py and explained in docs/KERNELS.md ("KV quantization").
"""

from __future__ import annotations

import torch

from kvmesh_kernels.cache import FP8_DTYPE

QMAX = {"int8": 127.0, "fp8": 448.0}
# Smallest scale, so an all-zero row quantizes to zeros instead of dividing by zero.
MIN_SCALE = 1e-8


def quantize(x: torch.Tensor, kv_dtype: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize [..., head_dim] per row; returns (values [..., head_dim], scales [...] float32)."""
    if kv_dtype not in QMAX:
        raise ValueError(f"kv_dtype must be 'int8' or 'fp8', got {kv_dtype!r}")
    xf = x.float()  # [..., head_dim]
    scales = (xf.abs().amax(dim=-1) / QMAX[kv_dtype]).clamp_min(MIN_SCALE)  # [...]
    scaled = xf / scales.unsqueeze(-1)  # [..., head_dim]
    if kv_dtype == "int8":
        values = scaled.round_().clamp_(-127, 127).to(torch.int8)
    else:
        values = scaled.clamp_(-448.0, 448.0).to(FP8_DTYPE)
    return values, scales


def dequantize(values: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Inverse of quantize: values [..., head_dim], scales [...] -> [..., head_dim] in dtype."""
    return (values.float() * scales.unsqueeze(-1)).to(dtype)
