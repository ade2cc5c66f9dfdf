"""kvmesh's GEMM for linear layers on x86-64 CPUs (`csrc/cpu_gemm.cpp`): bfloat16 (AMX tiles,
or AVX-512 with AVX512_BF16) and float32 (AVX-512, or AVX2 + FMA).

    gemm_supported(dtype) -> bool              the library is built and this CPU runs it
    gemm_path(dtype, k=None) -> str            which path: none, avx2, avx512, amx (of inner
                                               size k when given)
    weight_fits(w) -> bool                     pack_weight takes w
    pack_weight(w) -> PackedWeight             w [out, in] (bfloat16: in even), packed once
    pack_bias(bias, packed) -> float32 bias    padded to whole panels, once
    linear(x, packed, bias) -> y               x [..., in] (any strides) -> y [..., out] =
                                               x . w^T + bias in the weight's dtype, float32
                                               sums (bfloat16 rounded once at the end)
    gate_up_fits(w) -> bool                    pack_gate_up takes w
    pack_gate_up(w) -> PackedWeight            w [2 * I, in] (gate | up), interleaved + packed
    gate_up_silu(x, packed) -> y               x [..., in] -> silu(x . gate^T) * (x . up^T)
                                               [..., I]: the MLP's first half in one call

The path is chosen at run time (`KVMESH_CPU_KERNEL_ISA` caps it). `gate_up_silu` applies
SiLU-and-mul in the GEMM's epilogue, from the sums in registers, so the [..., 2 * I] product
is never written or read back; it equals `linear` followed by `cpu_fused.silu_mul` bit for bit
on the same path. bfloat16 is oneDNN's
arithmetic on these CPUs (vdpbf16ps, or tdpbf16ps on AMX: pairs of exact products added into
float32, subnormal inputs read as zero, round to nearest even at the end), float32 one FMA per
k in order; the
order of the float32 additions differs from oneDNN's and MKL's, so results match them to
rounding, not bit for bit. The gain is in decode-sized steps, where every step streams the
weights from memory: the kernel prefetches each thread's next weight panel while it computes
the current one, from 5 rows on (docs/BENCHMARKS.md "kvmesh's CPU GEMM"; below that the
multiply-adds are too short to hide the requests: "The GEMM's weight prefetch at a few rows").
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass

import torch

from kvmesh_kernels.cpu_build import library

_P, _I = ctypes.c_void_p, ctypes.c_int64
_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}
PANEL = 32  # output columns per packed panel


def gemm_supported(dtype: torch.dtype) -> bool:
    """True when the kernel library is built and this CPU runs the GEMM of `dtype` (AVX-512;
    bfloat16 also needs AVX512_BF16)."""
    lib = library()
    code = _DTYPE_CODES.get(dtype)
    return lib is not None and code is not None and bool(lib.kvmesh_cpu_gemm_supported(code))


PATHS = ("none", "avx2", "avx512", "amx")  # kvmesh_cpu_gemm_path's codes, in order


def gemm_path(dtype: torch.dtype, in_features: int | None = None) -> str:
    """The path this CPU runs for `dtype` under `KVMESH_CPU_KERNEL_ISA` (one of PATHS); with
    `in_features`, the path of a GEMM of that inner size (amx runs bfloat16 inner sizes that
    are a multiple of its tile's 32 k; others take avx512)."""
    lib = library()
    code = _DTYPE_CODES.get(dtype)
    if lib is None or code is None:
        return "none"
    if in_features is None:
        return PATHS[lib.kvmesh_cpu_gemm_path(code)]
    return PATHS[lib.kvmesh_cpu_gemm_path_for_k(code, _I(in_features))]


def weight_fits(weight: torch.Tensor) -> bool:
    """Whether `pack_weight` takes this weight: a float32 or bfloat16 CPU matrix with unit
    inner stride (bfloat16: an even inner size)."""
    return (
        weight.dtype in _DTYPE_CODES
        and weight.device.type == "cpu"
        and weight.dim() == 2
        and weight.stride(1) == 1
        and (weight.dtype == torch.float32 or weight.shape[1] % 2 == 0)
    )


@dataclass(frozen=True)
class PackedWeight:
    """A [out_features, in_features] weight in the kernel's panel layout."""

    data: torch.Tensor  # [ceil(out / 32) * 32 * in] in the weight's dtype, the packed panels
    out_features: int
    in_features: int
    interleave: int = 0  # pack_gate_up's run width (gate_up_silu's weights), 0: a plain weight

    @property
    def padded_out(self) -> int:
        """out_features rounded up to whole 32-column panels."""
        return -(-self.out_features // PANEL) * PANEL


def pack_weight(weight: torch.Tensor) -> PackedWeight:
    """weight [out, in] (`weight_fits`) -> its packed panels (a copy)."""
    assert weight_fits(weight), "pack_weight takes a float32 or bfloat16 (even inner size) matrix"
    lib = library()
    assert lib is not None, "CPU kernel library unavailable (check gemm_supported first)"
    out_features, in_features = (int(n) for n in weight.shape)
    lib.kvmesh_cpu_gemm_packed_elems.restype = ctypes.c_int64
    elems = lib.kvmesh_cpu_gemm_packed_elems(_I(out_features), _I(in_features))
    data = torch.empty(int(elems), dtype=weight.dtype)  # [panels * 32 * in]
    rc = lib.kvmesh_cpu_gemm_pack(
        ctypes.c_int(_DTYPE_CODES[weight.dtype]),
        _P(weight.data_ptr()),
        _I(weight.stride(0)),
        _I(out_features),
        _I(in_features),
        _P(data.data_ptr()),
    )
    if rc != 0:
        raise RuntimeError(f"kvmesh_cpu_gemm_pack rejected its arguments (code {rc})")
    return PackedWeight(data, out_features, in_features)


@functools.cache
def silu_width() -> dict[torch.dtype, int]:
    """Per dtype, the gate (then up) run width of `pack_gate_up`'s interleave on this CPU's
    path (0: the GEMM does not run); asked once (the path is fixed per process)."""
    lib = library()
    if lib is None:
        return {dtype: 0 for dtype in _DTYPE_CODES}
    width = lib.kvmesh_cpu_gemm_silu_width
    return {dtype: int(width(code)) for dtype, code in _DTYPE_CODES.items()}


def gate_up_fits(weight: torch.Tensor) -> bool:
    """Whether `pack_gate_up` takes this gate|up weight [2 * I, in]: `weight_fits`, I a
    multiple of 16 and the GEMM of its dtype running here."""
    rows = int(weight.shape[0]) if weight.dim() == 2 else 0
    return weight_fits(weight) and rows % (2 * 16) == 0 and silu_width().get(weight.dtype, 0) > 0


def gate_up_order(intermediate: int, width: int) -> torch.Tensor:
    """The row order of the interleaved gate|up weight [2 * I]: packed column c holds row
    order[c] of the plain weight (gate rows 0..I-1, up rows I..2I-1); per 16 output columns,
    runs of `width` gate rows, each followed by the same up rows."""
    j = torch.arange(intermediate)  # [I] output columns
    within = j % 16
    gate_col = (j // 16) * 32 + (within // width) * 2 * width + within % width  # [I]
    order = torch.empty(2 * intermediate, dtype=torch.int64)  # [2I]
    order[gate_col] = j
    order[gate_col + width] = j + intermediate
    return order


def pack_gate_up(weight: torch.Tensor) -> PackedWeight:
    """weight [2 * I, in] (gate rows, then up rows; `gate_up_fits`) -> packed for
    `gate_up_silu`, its rows interleaved for this CPU's path; out_features is 2 * I."""
    assert gate_up_fits(weight), "pack_gate_up takes a gate|up weight with I a multiple of 16"
    width = silu_width()[weight.dtype]
    order = gate_up_order(weight.shape[0] // 2, width)
    packed = pack_weight(weight.detach().index_select(0, order).contiguous())
    return PackedWeight(packed.data, packed.out_features, packed.in_features, width)


def gate_up_silu(x: torch.Tensor, weight: PackedWeight) -> torch.Tensor:
    """x [..., in] in the weight's dtype (any strides), weight from `pack_gate_up` ->
    silu(gate) * up [..., I] in that dtype. ValueError for operands the kernel cannot take,
    and for a weight not packed by `pack_gate_up` for this CPU's path."""
    _check_operands(x, weight, None)
    if weight.interleave != silu_width().get(x.dtype) or weight.out_features % (2 * 16):
        raise ValueError("weight: a gate|up weight from pack_gate_up on this CPU's path")
    rows_x = _rows_of(x)  # [rows, in]
    rows, in_features = rows_x.shape
    half = weight.out_features // 2
    out = torch.empty((rows, half), dtype=x.dtype)  # [rows, I]
    lib = library()
    assert lib is not None
    rc = lib.kvmesh_cpu_gemm_silu_mul(
        ctypes.c_int(_DTYPE_CODES[x.dtype]),
        _P(rows_x.data_ptr()),
        _I(rows_x.stride(0) if rows > 1 else in_features),
        _P(weight.data.data_ptr()),
        _P(out.data_ptr()),
        _I(half),
        _I(rows),
        _I(weight.out_features),
        _I(in_features),
        _I(torch.get_num_threads()),
    )
    if rc != 0:
        raise RuntimeError(f"kvmesh_cpu_gemm_silu_mul rejected its arguments (code {rc})")
    return out if x.dim() == 2 else out.reshape(*x.shape[:-1], half)


def _rows_of(x: torch.Tensor) -> torch.Tensor:
    """x as [rows, in] with unit column stride and rows apart by at least `in`."""
    rows_x = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])  # [rows, in]
    rows, in_features = rows_x.shape
    if rows_x.stride(-1) != 1 or (rows > 1 and rows_x.stride(0) < in_features):
        rows_x = rows_x.contiguous()  # strided columns, or an expanded row
    return rows_x


def pack_bias(bias: torch.Tensor, weight: PackedWeight) -> torch.Tensor:
    """bias [out] (any float dtype) -> float32 [weight.padded_out], zeros past out."""
    assert bias.shape == (weight.out_features,)
    padded = torch.zeros(weight.padded_out, dtype=torch.float32)  # [padded_out]
    padded[: weight.out_features] = bias.detach().float()
    return padded


def linear(
    x: torch.Tensor, weight: PackedWeight, bias: torch.Tensor | None, prefetch: bool = True
) -> torch.Tensor:
    """x [..., in] in the weight's dtype (any strides), bias from `pack_bias` or None ->
    [..., out] in that dtype. ValueError for operands the kernel cannot take.
    `prefetch=False` turns the weight prefetch off (only to measure what it gains; it is off
    below 5 rows either way)."""
    _check_operands(x, weight, bias)
    if weight.interleave:
        raise ValueError("weight: interleaved by pack_gate_up, for gate_up_silu only")
    rows_x = _rows_of(x)  # [rows, in]
    rows, in_features = rows_x.shape
    out = torch.empty((rows, weight.out_features), dtype=x.dtype)  # [rows, out]
    lib = library()
    assert lib is not None
    rc = lib.kvmesh_cpu_gemm(
        ctypes.c_int(_DTYPE_CODES[x.dtype]),
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
        ctypes.c_int(int(prefetch)),
    )
    if rc != 0:
        raise RuntimeError(f"kvmesh_cpu_gemm rejected its arguments (code {rc})")
    return out if x.dim() == 2 else out.reshape(*x.shape[:-1], weight.out_features)


def _check_operands(x: torch.Tensor, weight: PackedWeight, bias: torch.Tensor | None) -> None:
    """What the kernel reads must be what it assumes: checked always (not an assert)."""
    if x.device.type != "cpu" or x.dtype != weight.data.dtype or x.dim() < 1:
        raise ValueError(f"x: a CPU {weight.data.dtype} tensor, got {x.dtype} on {x.device}")
    if x.shape[-1] != weight.in_features:
        raise ValueError(f"x: last dimension {weight.in_features}, got shape {tuple(x.shape)}")
    if bias is not None and not (
        bias.device.type == "cpu"
        and bias.dtype == torch.float32
        and bias.shape == (weight.padded_out,)
        and bias.is_contiguous()
    ):
        raise ValueError(f"bias: float32 [{weight.padded_out}] from pack_bias, got {bias.shape}")
