"""Building blocks of the native executor: linears, RMSNorm (+ residual add), SiLU-and-mul.

Every function computes transformers' Llama-family arithmetic in the same order and dtype, so
float32 results agree with transformers' to the rounding of the matmul shapes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from kvmesh_kernels.cpu_norm import rms_norm_bf16, rms_norm_supported
from torch import nn

from kvmesh.engine.cpu_linear import PackedLinear
from kvmesh.engine.cpu_norm import fused_norm_applies


class PlainLinear(nn.Module):
    """x [..., in] -> [..., out] through `F.linear` (float32 on CPU, every dtype on CUDA)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.weight = nn.Parameter(weight.detach().contiguous(), requires_grad=False)  # [out, in]
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


def make_linear(weight: torch.Tensor, bias: torch.Tensor | None, pack: bool) -> nn.Module:
    """A linear over weight [out, in]: oneDNN-packed when `pack` (CPU bf16/fp16), else plain."""
    return PackedLinear.from_weight(weight, bias) if pack else PlainLinear(weight, bias)


def merged_linear(parts: list[nn.Module], pack: bool) -> nn.Module:
    """One linear whose output is the concatenation of `parts`' outputs (q|k|v, gate|up)."""
    weight = torch.cat([p.get_parameter("weight").detach() for p in parts])  # [sum out, in]
    biases = [getattr(p, "bias", None) for p in parts]
    if all(b is None for b in biases):
        return make_linear(weight, None, pack)
    zeros = [torch.zeros(p.get_parameter("weight").shape[0], dtype=weight.dtype) for p in parts]
    bias = torch.cat(
        [b.detach() if b is not None else z for b, z in zip(biases, zeros, strict=True)]
    )
    return make_linear(weight, bias, pack)


class RMSNorm(nn.Module):
    """transformers' LlamaRMSNorm formula: x [..., D] -> [..., D] (float32 statistics)."""

    def __init__(self, weight: torch.Tensor, eps: float):
        super().__init__()
        self.weight = nn.Parameter(weight.detach(), requires_grad=False)  # [D]
        self.eps = eps
        self.fused = fused_norm_applies(weight.dtype, weight.device)  # CPU bfloat16 kernel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused and rms_norm_supported(x, self.weight):
            return rms_norm_bf16(x, self.weight, self.eps)
        input_dtype = x.dtype
        h = x.to(torch.float32)
        variance = h.pow(2).mean(-1, keepdim=True)
        h = h * torch.rsqrt(variance + self.eps)
        return self.weight * h.to(input_dtype)

    def add_forward(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual): the decoder layer's residual add, then norm."""
        total = x + residual
        return self(total), total


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2 * I] (gate | up) -> silu(gate) * up [T, I]."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
