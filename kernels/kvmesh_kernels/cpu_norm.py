"""Fused bfloat16 RMSNorm on CPU for transformers' norm modules (`csrc/cpu_fused_ops.cpp`).

`rms_norm_bf16(x, weight, eps)` computes, in one pass per row, what transformers' Llama-family
RMSNorm computes in bfloat16 with eight tensor operations: upcast, normalise in float32, round
to bfloat16, multiply by the weight, round again.
"""

from __future__ import annotations

import torch

from kvmesh_kernels import cpu_fused
from kvmesh_kernels.cpu_build import library


def rms_norm_supported(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """CPU bfloat16 rows with unit element stride, a matching bfloat16 weight, library built."""
    return (
        x.device.type == "cpu"
        and x.dtype == torch.bfloat16
        and weight.dtype == torch.bfloat16
        and weight.device.type == "cpu"
        and weight.dim() == 1
        and weight.is_contiguous()
        and x.dim() >= 1
        and x.shape[-1] == weight.shape[0]
        and x.stride(-1) == 1
        and _rows_are_evenly_strided(x)
        and library() is not None
    )


def rms_norm_bf16(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., D] bf16, weight [D] bf16 -> [..., D] bf16 contiguous (check rms_norm_supported).
    One row pass of `cpu_fused.rms_norm`, the kernel the native executor's norms use."""
    dim = x.shape[-1]
    if x.numel() == 0:
        return torch.empty(x.shape, dtype=x.dtype)
    rows = x.view(-1, dim) if x.is_contiguous() else x  # [rows, D] (a 2-D view otherwise)
    return cpu_fused.rms_norm(rows, weight, eps).view(x.shape)


def _rows_are_evenly_strided(x: torch.Tensor) -> bool:
    """All leading dims collapse into one row index with one stride: contiguous, or a 2-D view
    whose rows are `x.stride(0)` elements apart (a column slice)."""
    return x.is_contiguous() or (x.dim() == 2 and x.stride(0) >= x.shape[-1])
