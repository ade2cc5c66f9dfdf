"""Shapes kvmesh reads off a transformers config in more than one place."""

from __future__ import annotations

from typing import Any


def head_dim_of(hf_config: Any) -> int:
    """The attention head size: the config's `head_dim` when it sets one (Qwen3 and some
    Mistral configs do), else hidden_size / num_attention_heads."""
    explicit = getattr(hf_config, "head_dim", None)
    return int(explicit or int(hf_config.hidden_size) // int(hf_config.num_attention_heads))
