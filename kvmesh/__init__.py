"""kvmesh: disaggregated prefill/decode LLM serving over gRPC on a paged KV cache.

Attributes are imported lazily so that `import kvmesh` (and the generated stubs under
`kvmesh.v1`) never pull in torch.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_LAZY = {
    "LLM": "kvmesh.engine.llm",
    "Logprob": "kvmesh.engine.logprobs",
    "SamplingParams": "kvmesh.engine.sampling_params",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'kvmesh' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


__all__ = ["LLM", "Logprob", "SamplingParams", "__version__"]
