"""Paged-attention and KV-cache kernels: torch references and Triton kernels.

Attributes load lazily, so `import kvmesh_kernels` imports neither torch nor triton.
See `cache` for the layout and `dispatch` for the operation contracts.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "KVCacheSpec": "cache",
    "PagedKVCache": "cache",
    "LayerKV": "cache",
    "PackedBlocks": "cache",
    "PackedBytes": "cache",
    "allocate_kv_cache": "cache",
    "gather_blocks": "cache",
    "scatter_blocks": "cache",
    "packed_to_bytes": "cache",
    "packed_from_bytes": "cache",
    "spec_to_dict": "cache",
    "spec_from_dict": "cache",
    "quantize": "quant",
    "dequantize": "quant",
    "write_kv": "dispatch",
    "copy_blocks": "dispatch",
    "paged_decode_attention": "dispatch",
    "paged_prefill_attention": "dispatch",
    "paged_attention": "dispatch",
    "set_backend": "dispatch",
    "get_backend": "dispatch",
    "BackendUnavailableError": "dispatch",
    "AttentionPlan": "plan",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'kvmesh_kernels' has no attribute {name!r}")
    return getattr(importlib.import_module(f"kvmesh_kernels.{module}"), name)
