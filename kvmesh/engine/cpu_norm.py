"""Fused RMSNorm for bfloat16 models on CPU, swapped in for transformers' Llama-family norms.

transformers' `LlamaRMSNorm.forward` (shared verbatim by Qwen2, Qwen3 and Mistral) runs eight
tensor operations per call: upcast, square, mean, add, rsqrt, multiply, downcast, multiply by
the weight. In a decode step each is a few hundred elements per row and the call overhead is
the cost. `FusedRMSNorm` computes the same formula with the same roundings in one kernel
(`kvmesh_kernels.cpu_norm`), like transformers' own `use_kernel_forward_from_hub("RMSNorm")`
hook does with downloaded kernels. Only the float32 sum of squares is added in a different
order, so an output differs from transformers' by at most one bfloat16 rounding step, and
rarely (a few elements in 10^5 at width 4096; none measured at width 512). The swap is checked
at load: on a random probe the fused module must agree with the original within that step, so
a norm whose formula differs (another transformers version, another model) keeps its own code.
"""

from __future__ import annotations

import logging

import torch
from kvmesh_kernels.cpu_norm import rms_norm_bf16, rms_norm_supported
from torch import nn

logger = logging.getLogger(__name__)

NORM_CLASSES = ("LlamaRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm", "MistralRMSNorm")


class FusedRMSNorm(nn.Module):
    """The Llama-family RMSNorm with a fused bfloat16 CPU path: x [..., D] -> [..., D]."""

    weight: nn.Parameter  # [D], shared with the original module

    def __init__(self, norm: nn.Module):
        super().__init__()
        self.weight = norm.get_parameter("weight")
        self.variance_epsilon = float(getattr(norm, "variance_epsilon"))  # noqa: B009

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if rms_norm_supported(hidden_states, self.weight):
            return rms_norm_bf16(hidden_states, self.weight, self.variance_epsilon)
        input_dtype = hidden_states.dtype  # transformers' formula, verbatim
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}, fused=cpu-bf16"


def fused_norm_applies(dtype: torch.dtype, device: torch.device) -> bool:
    """bfloat16 models on CPU (the kernel's only dtype)."""
    return device.type == "cpu" and dtype == torch.bfloat16


def fuse_rms_norms(model: nn.Module) -> int:
    """Swap every known RMSNorm under `model` for a FusedRMSNorm that agrees with it on a
    probe input (see the module docstring); returns how many were swapped."""
    targets = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if type(child).__name__ in NORM_CLASSES
    ]
    swapped = 0
    for parent, name, child in targets:
        fused = FusedRMSNorm(child)
        if _matches(child, fused):
            setattr(parent, name, fused)
            swapped += 1
    if swapped < len(targets):
        logger.warning(
            "kept %d RMSNorm modules whose output the fused kernel did not match",
            len(targets) - swapped,
        )
    return swapped


def _matches(original: nn.Module, fused: FusedRMSNorm) -> bool:
    generator = torch.Generator().manual_seed(0)
    width = int(fused.weight.shape[0])
    probe = torch.randn(33, width, generator=generator).to(fused.weight.dtype)  # [33, D]
    with torch.inference_mode():
        expected = original(probe).float()  # [33, D]
        got = fused(probe).float()
    one_rounding = expected.abs() * 2.0**-7 + torch.finfo(torch.bfloat16).tiny
    return bool(((expected - got).abs() <= one_rounding).all())
