"""`torch.compile` of the native executor's per-layer math (EngineConfig `compile="on"`).

Each decoder layer has two compiled regions around its attention call (which stays eager: it
writes the paged KV cache and runs kvmesh's attention kernels):

    pre_attention    residual add + RMSNorm, q|k|v GEMM, Qwen3 q/k norms, rotary
    post_attention   o GEMM, residual add + RMSNorm, gate|up GEMM, SiLU-and-mul, down GEMM

Inside the regions the elementwise math is torch's formula (the fused ctypes kernels are
opaque to the compiler), so inductor generates and fuses it; the GEMMs stay library calls.
Shapes are dynamic in the token count (one graph per region for every batch size, plus the
size-1 specialisation), and every layer reuses the same graphs (its weights are inputs).
Compilation happens on the first steps (the engine's warm-up runs them before it serves).
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from kvmesh.engine.config import COMPILE_MODES
from kvmesh.engine.native.llama import NativeCausalLM, NativeDecoderLayer

logger = logging.getLogger(__name__)

__all__ = ["COMPILE_MODES", "compile_native"]


def compile_native(model: NativeCausalLM) -> NativeCausalLM:
    """Switch `model`'s layers to compiled regions (in place; returns the model)."""
    model.rotary.fused = False  # rotary from table rows, traced into pre_attention
    for layer in model.layers:
        assert isinstance(layer, NativeDecoderLayer)
        for norm in (layer.input_norm, layer.post_attention_norm, layer.q_norm, layer.k_norm):
            if norm is not None:
                norm.fused = False
        layer.call_linears_directly(False)  # the regions trace the modules
        layer.pre_attention = _compiled(layer.pre_attention)  # type: ignore[method-assign]
        layer.post_attention = _compiled(layer.post_attention)  # type: ignore[method-assign]
    logger.info("native executor: per-layer math compiled (torch.compile, inductor)")
    return model


def _compiled(method: Any) -> Any:
    return torch.compile(method, dynamic=True, fullgraph=True)
