"""Fused bfloat16 RMSNorm on CPU (`csrc/cpu_rms_norm.cpp`, built into the fused CPU library).

`rms_norm_bf16(x, weight, eps)` computes, in one pass per row, what transformers' Llama-family
RMSNorm computes in bfloat16 with eight tensor operations: upcast, normalise in float32, round
to bfloat16, multiply by the weight, round again.
"""

from __future__ import annotations

import ctypes

import torch

from kvmesh_kernels.cpu_build import library

NORM_ENTRY = "kvmesh_cpu_rms_norm_bf16"


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
    """x [..., D] bf16, weight [D] bf16 -> [..., D] bf16 contiguous (check rms_norm_supported)."""
    lib = library()
    assert lib is not None, "fused CPU library unavailable (check rms_norm_supported first)"
    dim = x.shape[-1]
    rows = x.numel() // dim if dim else 0
    out = torch.empty(x.shape, dtype=x.dtype)  # [..., D]
    if rows == 0:
        return out
    row_stride = x.stride(-2) if x.dim() >= 2 else dim
    rc = getattr(lib, NORM_ENTRY)(
        ctypes.c_void_p(x.data_ptr()),
        ctypes.c_int64(rows),
        ctypes.c_int64(row_stride),
        ctypes.c_void_p(weight.data_ptr()),
        ctypes.c_void_p(out.data_ptr()),
        ctypes.c_int64(dim),
        ctypes.c_double(eps),
        ctypes.c_int64(torch.get_num_threads()),
    )
    if rc != 0:
        raise RuntimeError(f"fused RMSNorm kernel rejected its arguments (code {rc})")
    return out


def _rows_are_evenly_strided(x: torch.Tensor) -> bool:
    """All leading dims collapse into one row index with one stride: contiguous, or a 2-D view
    whose rows are `x.stride(0)` elements apart (a column slice)."""
    return x.is_contiguous() or (x.dim() == 2 and x.stride(0) >= x.shape[-1])
