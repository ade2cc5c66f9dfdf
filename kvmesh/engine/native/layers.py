"""Building blocks of the native executor: linears, RMSNorm (+ residual add), SiLU-and-mul.

Every function computes transformers' Llama-family arithmetic in the same order and dtype, so
float32 results agree with transformers' to the rounding of the matmul shapes.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from kvmesh_kernels import cpu_fused, cpu_gemm
from torch import nn

from kvmesh.engine.cpu_linear import CpuGemmGateUpSilu, CpuGemmLinear, PackedLinear

LINEAR_KINDS = ("kvmesh", "onednn", "plain")  # make_linear's kinds


class PlainLinear(nn.Module):
    """x [..., in] -> [..., out] through `F.linear` (float32 on CPU, every dtype on CUDA)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.weight = nn.Parameter(weight.detach().contiguous(), requires_grad=False)  # [out, in]
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


def direct_call(linear: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    """The function that computes `linear(x)` eagerly, without nn.Module's `__call__`."""
    if isinstance(linear, PackedLinear):
        return linear.run
    return linear.forward  # type: ignore[no-any-return]


def make_linear(weight: torch.Tensor, bias: torch.Tensor | None, kind: str) -> nn.Module:
    """A linear over weight [out, in] of `kind` (`LINEAR_KINDS`): kvmesh's CPU GEMM ("kvmesh":
    float32 or bfloat16; oneDNN-packed instead for a weight it does not take), oneDNN-packed
    ("onednn": CPU bf16/fp16, float32 where it measured faster), or `F.linear` ("plain")."""
    if kind == "kvmesh" and cpu_gemm.weight_fits(weight):
        return CpuGemmLinear.from_weight(weight, bias)
    if kind in ("kvmesh", "onednn"):
        return PackedLinear.from_weight(weight, bias)
    return PlainLinear(weight, bias)


def merged_weight(parts: list[nn.Module]) -> torch.Tensor:
    """The parts' weights stacked: [sum of their out, in]."""
    return torch.cat([p.get_parameter("weight").detach() for p in parts])


def merged_linear(parts: list[nn.Module], kind: str) -> nn.Module:
    """One linear of `kind` whose output is the concatenation of `parts`' outputs (q|k|v,
    gate|up)."""
    weight = merged_weight(parts)  # [sum out, in]
    biases = [getattr(p, "bias", None) for p in parts]
    if all(b is None for b in biases):
        return make_linear(weight, None, kind)
    bias = torch.cat(
        [
            b.detach() if b is not None else weight.new_zeros(p.get_parameter("weight").shape[0])
            for p, b in zip(parts, biases, strict=True)
        ]
    )  # [sum out], zeros where a part has no bias, on the weight's device
    return make_linear(weight, bias, kind)


def gate_up_linear(parts: list[nn.Module], kind: str) -> nn.Module:
    """The MLP's merged gate|up linear (`merged_linear` of gate_proj, up_proj), or, for kvmesh's
    GEMM where it takes the weight (no biases, I a multiple of 16), the same GEMM with
    SiLU-and-mul in its epilogue (`CpuGemmGateUpSilu`: `activates(module)` is true, its output
    is the activation [T, I] instead of gate|up [T, 2 * I])."""
    if kind != "kvmesh" or any(getattr(p, "bias", None) is not None for p in parts):
        return merged_linear(parts, kind)
    weight = merged_weight(parts)  # [2I, in]
    if cpu_gemm.gate_up_fits(weight):
        return CpuGemmGateUpSilu.from_weight(weight, None)
    return make_linear(weight, None, kind)


def activates(gate_up: nn.Module) -> bool:
    """Whether a gate|up linear already applies SiLU-and-mul (`gate_up_linear`)."""
    return bool(getattr(gate_up, "activates", False))


class RMSNorm(nn.Module):
    """transformers' LlamaRMSNorm formula: x [..., D] -> [..., D] (float32 statistics).

    On CPU in float32 and bfloat16 one fused kernel pass per row (`kvmesh_kernels.cpu_fused`,
    transformers' roundings); elsewhere transformers' formula verbatim.
    """

    def __init__(self, weight: torch.Tensor, eps: float):
        super().__init__()
        self.weight = nn.Parameter(weight.detach().contiguous(), requires_grad=False)  # [D]
        self.eps = eps
        self.fused = cpu_fused.fused_supported(self.weight)  # decided once: dtype, device, library

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = _as_rows(x)
        if self.fused and rows is not None and rows.stride(-1) == 1:
            return cpu_fused.rms_norm(rows, self.weight, self.eps).view(x.shape)
        input_dtype = x.dtype
        h = x.to(torch.float32)
        variance = h.pow(2).mean(-1, keepdim=True)
        h = h * torch.rsqrt(variance + self.eps)
        return self.weight * h.to(input_dtype)

    def heads_(self, x: torch.Tensor) -> torch.Tensor:
        """Norm of every head of x [T, H, D] (Qwen3's q/k norms): in place on the fused path
        (x token- and head-strided with unit last stride, as a view of the q|k|v output is),
        else transformers' formula into a new tensor; returns the result [T, H, D]."""
        if self.fused and x.dim() == 3 and x.stride(-1) == 1:
            cpu_fused.head_rms_norm_(x, self.weight, self.eps)
            return x
        return self(x)

    def add_forward(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual): the decoder layer's residual add, then norm.
        The fused path updates `residual` in place (the caller's residual stream)."""
        if self.fused and x.dim() == 2 and x.stride(-1) == 1 and residual.is_contiguous():
            return cpu_fused.add_rms_norm(x, residual, self.weight, self.eps), residual
        total = x + residual
        return self(total), total


def _as_rows(x: torch.Tensor) -> torch.Tensor | None:
    """x as [rows, D] without a copy (2-D, or contiguous), else None."""
    if x.dim() == 2:
        return x
    if x.is_contiguous():
        return x.view(-1, x.shape[-1])
    return None


FUSED_SILU_MIN_OUTPUTS = 1 << 14
"""Below this many outputs (T * I) torch's two calls cost less than the kernel's ctypes call
(measured break-even: 8-16 rows of I = 1376, one thread)."""


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2 * I] (gate | up) -> silu(gate) * up [T, I].

    On CPU in float32 and bfloat16, from FUSED_SILU_MIN_OUTPUTS outputs on, one fused kernel
    pass (`kvmesh_kernels.cpu_fused.silu_mul`: bfloat16 rounds as torch's two ops, float32
    within a few ulps); otherwise, and while `torch.compile` traces it (the ctypes call is
    opaque to it), torch's formula verbatim.
    """
    if (
        gate_up.dim() == 2
        and gate_up.numel() >= 2 * FUSED_SILU_MIN_OUTPUTS
        and not torch.compiler.is_compiling()
        and cpu_fused.fused_supported(gate_up)
    ):
        return cpu_fused.silu_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)  # [T, I] views
    return F.silu(gate) * up
