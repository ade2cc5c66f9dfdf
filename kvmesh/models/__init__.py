"""Model checkpoints: resolving `--model`, the default model, GGUF conversion, tiny models."""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "build_tiny_model": "kvmesh.models.tiny",
    "tiny_config": "kvmesh.models.tiny",
    "ARCHS": "kvmesh.models.tiny",
    "SIZES": "kvmesh.models.tiny",
    "tiny_model_path": "kvmesh.models.tiny",
    "default_model_path": "kvmesh.models.default",
    "gguf_checkpoint": "kvmesh.models.gguf",
    "convert_gguf": "kvmesh.models.gguf",
    "resolve_model_path": "kvmesh.models.resolve",
    "ModelNotFoundError": "kvmesh.models.resolve",
    "build_byte_tokenizer": "kvmesh.models.tokenizer",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'kvmesh.models' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


__all__ = sorted(_LAZY)
