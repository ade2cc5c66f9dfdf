"""kvmesh's bfloat16 GEMM for linear layers on CPUs with AVX512_BF16 (`csrc/cpu_gemm_bf16.cpp`).

    gemm_supported() -> bool                   the library is built and this CPU runs it
    pack_weight(w) -> PackedWeight             w bfloat16 [out, in] (in even), packed once
    linear(x, packed, bias) -> y               x bfloat16 [rows, in] (rows strided) ->
                                               y [rows, out] = x . w^T + bias, float32 sums
                                               rounded once to bfloat16

Same arithmetic as oneDNN's bfloat16 GEMM on these CPUs (vdpbf16ps: pairs of exact products
added into float32, subnormal inputs read as zero, round to nearest even at the end); the
order of the float32 additions differs, so results match a float32 reference to bfloat16
rounding, not bit for bit. Its gain is in decode-sized steps, where every step streams the
weights from memory: the kernel prefetches each thread's next weight panel while it computes
the current one (docs/BENCHMARKS.md "bfloat16 GEMM").
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from kvmesh_kernels.cpu_build import library

_P, _I = ctypes.c_void_p, ctypes.c_int64


def gemm_supported() -> bool:
    """True when the kernel library is built and this CPU has AVX-512 with AVX512_BF16."""
    lib = library()
    return lib is not None and bool(lib.kvmesh_cpu_gemm_bf16_supported())


def weight_fits(weight: torch.Tensor) -> bool:
    """Whether `pack_weight` takes this weight: a bfloat16 CPU matrix with an even inner size."""
    return (
        weight.dtype == torch.bfloat16
        and weight.device.type == "cpu"
        and weight.dim() == 2
        and weight.shape[1] % 2 == 0
        and weight.stride(1) == 1
    )


@dataclass(frozen=True)
class PackedWeight:
    """A [out_features, in_features] bfloat16 weight in the kernel's panel layout."""

    data: torch.Tensor  # bfloat16 [ceil(out / 32) * 32 * in], the packed panels
    out_features: int
    in_features: int


def pack_weight(weight: torch.Tensor) -> PackedWeight:
    """weight bfloat16 [out, in] (in even, unit inner stride) -> its packed panels (a copy)."""
    assert weight_fits(weight), "pack_weight takes a bfloat16 CPU matrix with an even inner size"
    lib = library()
    assert lib is not None, "CPU kernel library unavailable (check gemm_supported first)"
    out_features, in_features = (int(n) for n in weight.shape)
    lib.kvmesh_cpu_gemm_bf16_packed_elems.restype = ctypes.c_int64
    elems = lib.kvmesh_cpu_gemm_bf16_packed_elems(_I(out_features), _I(in_features))
    data = torch.empty(int(elems), dtype=torch.bfloat16)  # [panels * 32 * in]
    rc = lib.kvmesh_cpu_gemm_bf16_pack(
        _P(weight.data_ptr()),
        _I(weight.stride(0)),
        _I(out_features),
        _I(in_features),
        _P(data.data_ptr()),
    )
    if rc != 0:
        raise RuntimeError(f"kvmesh_cpu_gemm_bf16_pack rejected its arguments (code {rc})")
    return PackedWeight(data, out_features, in_features)


def linear(x: torch.Tensor, weight: PackedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    """x bfloat16 [..., in] (rows may be strided, unit inner stride), bias float32 [out] or
    None -> bfloat16 [..., out]."""
    rows_x = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])  # [rows, in]
    rows, in_features = rows_x.shape
    assert x.dtype == torch.bfloat16 and in_features == weight.in_features
    assert rows_x.stride(-1) == 1 and (bias is None or bias.dtype == torch.float32)
    out = torch.empty((rows, weight.out_features), dtype=torch.bfloat16)  # [rows, out]
    lib = library()
    assert lib is not None
    rc = lib.kvmesh_cpu_gemm_bf16(
        _P(rows_x.data_ptr()),
        _I(rows_x.stride(0) if rows > 1 else in_features),  # a lone row's stride is arbitrary
        _P(weight.data.data_ptr()),
        _P(None if bias is None else bias.data_ptr()),
        _P(out.data_ptr()),
        _I(weight.out_features),
        _I(rows),
        _I(weight.out_features),
        _I(in_features),
        _I(torch.get_num_threads()),
    )
    if rc != 0:
        raise RuntimeError(f"kvmesh_cpu_gemm_bf16 rejected its arguments (code {rc})")
    return out if x.dim() == 2 else out.reshape(*x.shape[:-1], weight.out_features)
