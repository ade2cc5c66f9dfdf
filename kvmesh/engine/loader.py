"""Load a local transformers checkpoint with kvmesh's paged attention (never from a hub).

Supported: decoder-only models whose transformers code routes attention through the attention
interface with a plain `lm_head` (Llama, Qwen2, Qwen3, Mistral with its sliding window).
Anything else fails here, at load, with UnsupportedModelError naming what is missing.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from kvmesh_kernels.cache import HEAD_DIMS
from kvmesh_kernels.cpu_build import has_amx
from kvmesh_kernels.cpu_gemm import gemm_path as kvmesh_gemm_path

from kvmesh.engine.attention import register_attention
from kvmesh.engine.config import EngineConfig
from kvmesh.engine.cpu_linear import (
    float32_packing_wins,
    kvmesh_gemm_applies,
    pack_linear_layers,
    packing_applies,
)
from kvmesh.engine.cpu_norm import fuse_rms_norms, fused_norm_applies
from kvmesh.engine.errors import InvalidParameterError, UnsupportedModelError
from kvmesh.engine.executor import choose_executor
from kvmesh.engine.hf_shapes import head_dim_of
from kvmesh.engine.native.build import build_native

logger = logging.getLogger(__name__)

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral")
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
_UNSUPPORTED_FEATURES = ("final_logit_softcapping", "attn_logit_softcapping", "logit_scale")


@dataclass(frozen=True)
class LoadedModel:
    """A model ready for the runner, its config, and its tokenizer (None when absent)."""

    path: Path
    model: Any  # transformers PreTrainedModel, eval mode, on `device`
    hf_config: Any
    tokenizer: Any | None
    dtype: torch.dtype
    device: torch.device
    executor: str = "transformers"  # "native" | "transformers" (kvmesh.engine.executor)
    linears: str = "plain"  # the linears' GEMM: native.layers.LINEAR_KINDS


def resolve_model_path(model: str | None) -> Path:
    """The checkpoint folder of `model` (`kvmesh.models.resolve`; None is the default model)."""
    from kvmesh.models.resolve import resolve_model_path as resolve

    return resolve(model)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise InvalidParameterError("device", "cuda requested but no CUDA device is available")
    return torch.device(name)


def resolve_dtype(name: str, hf_config: Any) -> torch.dtype:
    """`auto` = the checkpoint's dtype (float32 when it names none)."""
    if name != "auto":
        return _DTYPES[name]
    saved = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    if isinstance(saved, torch.dtype):
        return saved
    return _DTYPES.get(str(saved).removeprefix("torch."), torch.float32)


def check_supported(hf_config: Any) -> None:
    """Raise UnsupportedModelError unless the runner can execute this architecture."""
    model_type = getattr(hf_config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedModelError(
            f"model_type {model_type!r} is not supported "
            f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
        )
    for feature in _UNSUPPORTED_FEATURES:
        if getattr(hf_config, feature, None):
            raise UnsupportedModelError(f"{model_type}: {feature} is not supported")
    head_dim = head_dim_of(hf_config)
    if head_dim not in HEAD_DIMS:
        raise UnsupportedModelError(
            f"{model_type}: head_dim {head_dim} is not supported by the paged attention kernels "
            f"(supported: {', '.join(map(str, HEAD_DIMS))})"
        )


def load_model(config: EngineConfig) -> LoadedModel:
    """Load weights (progress bar when `show_progress`) and the optional tokenizer."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    path = resolve_model_path(config.model)
    hf_config = AutoConfig.from_pretrained(str(path), local_files_only=True)
    check_supported(hf_config)
    device = resolve_device(config.device)
    dtype = resolve_dtype(config.dtype, hf_config)
    if config.show_progress:
        hf_logging.enable_progress_bar()
    else:
        hf_logging.disable_progress_bar()
    model: Any = AutoModelForCausalLM.from_pretrained(
        str(path),
        dtype=dtype,
        attn_implementation=register_attention(),
        local_files_only=True,
    )
    model = model.to(device).eval().requires_grad_(False)
    executor = choose_executor(config.executor, model, hf_config)
    if executor == "native":
        generation_config = getattr(model, "generation_config", None)
        linears = native_linears(config, hf_config, dtype, device)
        model = build_native(model, hf_config, linears)
        logger.info("native linears: %s", linears)
        model.generation_config = generation_config
        if config.compile == "on":
            from kvmesh.engine.native.compiled import compile_native

            compile_native(model)
    else:
        linears = "onednn" if packing_applies(dtype, device) else "plain"
        if linears == "onednn":
            pack_linear_layers(model)
        if fused_norm_applies(dtype, device):
            fuse_rms_norms(model)
    logger.info("executor: %s for %s (%s)", executor, hf_config.model_type, dtype)
    tokenizer = load_tokenizer(path)
    return LoadedModel(path, model, hf_config, tokenizer, dtype, device, executor, linears)


def native_linears(
    config: EngineConfig, hf_config: Any, dtype: torch.dtype, device: torch.device
) -> str:
    """The native executor's linear kind (`native.layers.LINEAR_KINDS`): kvmesh's GEMM on a
    CPU that runs it for `dtype` (`cpu_gemm` kvmesh, or auto unless `amx_wins`), else
    oneDNN-packed for CPU bf16/fp16, and for CPU float32 as `float32_packing` says (auto:
    measured at load on the model's widest GEMM); plain `F.linear` otherwise."""
    on_cpu = device.type == "cpu"  # a GPU engine never asks for the CPU kernel library
    if config.cpu_gemm == "kvmesh" or (
        config.cpu_gemm == "auto" and not (on_cpu and amx_wins(dtype, hf_config))
    ):
        if kvmesh_gemm_applies(dtype, device):
            return "kvmesh"
    elif config.cpu_gemm == "auto" and on_cpu:
        logger.info(
            "AMX CPU: oneDNN's AMX GEMM for %s (kvmesh's AMX path %s)",
            dtype,
            "does not run here" if kvmesh_gemm_path(dtype) != "amx" else "takes no odd inner size",
        )
    if config.cpu_gemm == "kvmesh" and device.type == "cpu":
        logger.warning("cpu_gemm=kvmesh: this CPU or build has no %s GEMM of kvmesh's", dtype)
    if packing_applies(dtype, device):
        return "onednn"
    if dtype != torch.float32 or device.type != "cpu" or config.float32_packing == "off":
        return "plain"
    if config.float32_packing == "on":
        return "onednn" if torch.backends.mkldnn.is_available() else "plain"
    hidden = int(hf_config.hidden_size)
    wins = float32_packing_wins(hidden, 2 * int(hf_config.intermediate_size))
    logger.info("float32 linears: %s (measured at load)", "oneDNN-packed" if wins else "MKL")
    return "onednn" if wins else "plain"


def amx_wins(dtype: torch.dtype, hf_config: Any) -> bool:
    """Whether oneDNN's AMX tiles beat kvmesh's GEMM for `dtype` on this CPU: bfloat16 on a CPU
    with AMX where kvmesh's own AMX path does not run (a compiler or Linux kernel without it,
    or a `KVMESH_CPU_KERNEL_ISA` cap) or would not run every linear (an inner size that is not
    a multiple of the AMX tile's 32 k takes its AVX512_BF16 path, 1.3-8x oneDNN's time at 4-256
    rows).
    float32 has no AMX path (kvmesh's GEMM ran W1 1.22x faster than oneDNN's float32 there,
    1.06x in a disturbed repeat); BENCHMARKS.md "kvmesh's GEMM on AMX"."""
    if dtype != torch.bfloat16 or not has_amx():
        return False
    return any(kvmesh_gemm_path(dtype, size) != "amx" for size in linear_inner_sizes(hf_config))


def linear_inner_sizes(hf_config: Any) -> list[int]:
    """The in_features of a Llama-family layer's linears: hidden (q|k|v, gate|up), heads x
    head_dim (o) and intermediate (down)."""
    heads = int(hf_config.num_attention_heads)
    return [
        int(hf_config.hidden_size),
        heads * head_dim_of(hf_config),
        int(hf_config.intermediate_size),
    ]


def load_tokenizer(path: Path) -> Any | None:
    """The checkpoint's tokenizer, or None when the folder has none."""
    if not any((path / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json")):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
