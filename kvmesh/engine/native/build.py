"""Build a NativeCausalLM from a loaded transformers model, or say why it cannot be built.

Covered: the Llama family as transformers implements it (`LlamaForCausalLM`,
`Qwen2ForCausalLM`, `Qwen3ForCausalLM`, `MistralForCausalLM`; SmolLM2 is a Llama): SiLU MLPs,
RMSNorms, optional q/k/v/o and MLP biases, Qwen3's per-head q/k norms, per-layer sliding
windows, rope types with static frequencies. Weights are read from the transformers modules,
merged (q|k|v, gate|up) layer by layer, and each transformers layer is dropped once merged, so
peak memory stays about one layer above the model's size.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from kvmesh.engine.errors import UnsupportedModelError
from kvmesh.engine.hf_shapes import head_dim_of
from kvmesh.engine.native.layers import RMSNorm, gate_up_linear, make_linear, merged_linear
from kvmesh.engine.native.llama import AttentionShape, NativeCausalLM, NativeDecoderLayer
from kvmesh.engine.native.rope import RotaryTable, check_rope

NATIVE_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral")
_LAYER_CHILDREN = ("self_attn", "mlp", "input_layernorm", "post_attention_layernorm")


def check_native(hf_model: Any, hf_config: Any) -> None:
    """Raise UnsupportedModelError naming the first feature the native executor lacks."""
    model_type = getattr(hf_config, "model_type", None)
    if model_type not in NATIVE_MODEL_TYPES:
        raise UnsupportedModelError(
            f"model_type {model_type!r} has no native executor "
            f"(native: {', '.join(NATIVE_MODEL_TYPES)})"
        )
    act = getattr(hf_config, "hidden_act", "silu")
    if act != "silu":
        raise UnsupportedModelError(f"{model_type}: hidden_act {act!r} (native: silu)")
    check_rope(hf_config)
    inner = hf_model.model
    for index, layer in enumerate(inner.layers):
        missing = [name for name in _LAYER_CHILDREN if not hasattr(layer, name)]
        if missing:
            raise UnsupportedModelError(f"layer {index} lacks {', '.join(missing)}")


def build_native(hf_model: Any, hf_config: Any, linears: str) -> NativeCausalLM:
    """The native model over the transformers model's weights (check_native first).

    `linears`: the linear kind (`layers.make_linear`: "kvmesh", "onednn" or "plain"). The
    transformers model's decoder layers are emptied as they are converted; its embedding is
    shared.
    """
    check_native(hf_model, hf_config)
    inner = hf_model.model
    weight = inner.embed_tokens.weight
    layers = []
    for index in range(len(inner.layers)):
        layers.append(convert_layer(index, inner.layers[index], hf_config, linears))
        inner.layers[index] = nn.Identity()  # free the unmerged weights now
    head = hf_model.lm_head
    lm_head = make_linear(head.weight, getattr(head, "bias", None), linears)
    max_positions = int(getattr(hf_config, "max_position_embeddings", 0) or 32768)
    rotary = RotaryTable(inner.rotary_emb, max_positions, weight.dtype, weight.device)
    return NativeCausalLM(inner.embed_tokens, layers, norm_of(inner.norm), lm_head, rotary)


def convert_layer(index: int, layer: Any, hf_config: Any, linears: str) -> NativeDecoderLayer:
    attn, mlp = layer.self_attn, layer.mlp
    q_norm, k_norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
    return NativeDecoderLayer(
        index,
        attention_shape(attn, hf_config),
        (norm_of(layer.input_layernorm), norm_of(layer.post_attention_layernorm)),
        qkv=merged_linear([attn.q_proj, attn.k_proj, attn.v_proj], linears),
        o=make_linear(attn.o_proj.weight, getattr(attn.o_proj, "bias", None), linears),
        gate_up=gate_up_linear([mlp.gate_proj, mlp.up_proj], linears),
        down=make_linear(mlp.down_proj.weight, getattr(mlp.down_proj, "bias", None), linears),
        qk_norms=(norm_of(q_norm), norm_of(k_norm)) if q_norm is not None else None,
    )


def attention_shape(attn: Any, hf_config: Any) -> AttentionShape:
    """Heads from the config, the scale and window transformers' layer itself uses."""
    heads = int(hf_config.num_attention_heads)
    head_dim = head_dim_of(hf_config)
    kv_heads = int(getattr(hf_config, "num_key_value_heads", None) or heads)
    window = getattr(attn, "sliding_window", None)
    if window is None and getattr(hf_config, "model_type", None) == "mistral":
        window = getattr(hf_config, "sliding_window", None)  # Mistral passes it per call
    scale = float(getattr(attn, "scaling", head_dim**-0.5))
    return AttentionShape(heads, kv_heads, head_dim, scale, int(window) if window else None)


def norm_of(module: Any) -> RMSNorm:
    """An RMSNorm with the module's weight and epsilon (Llama-family norms name it either
    `variance_epsilon` or `eps`)."""
    eps: Any = getattr(module, "variance_epsilon", None)
    if eps is None:
        eps = getattr(module, "eps", 1e-6)
    weight: torch.Tensor = module.weight
    return RMSNorm(weight, float(eps))
