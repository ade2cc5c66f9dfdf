"""Tiny random-weight checkpoints, the byte-level tokenizer and the cached default model."""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "build_tiny_model": "kvmesh.models.tiny",
    "tiny_config": "kvmesh.models.tiny",
    "ARCHS": "kvmesh.models.tiny",
    "SIZES": "kvmesh.models.tiny",
    "default_model_path": "kvmesh.models.default",
    "resolve_model_path": "kvmesh.models.default",
    "build_byte_tokenizer": "kvmesh.models.tokenizer",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'kvmesh.models' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


__all__ = sorted(_LAZY)
