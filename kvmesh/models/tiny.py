"""Tiny random-weight checkpoints of the benchmark workloads (docs/BENCHMARK_SUITE.md), built
locally (no network).

`build_tiny_model(out_dir, arch, size, seed)` writes config.json, model.safetensors (float32),
generation_config.json and the byte-level tokenizer of `kvmesh.models.tokenizer`.
`tiny_model_path(size)` is the Llama of that size (seed 0) built once into kvmesh's cache: the
model of tests and benchmarks.

Weights: `torch.manual_seed(seed)` then `AutoModelForCausalLM.from_config(config)`, untied
embeddings. `initializer_range` is raised from transformers' 0.02 to `INITIALIZER_RANGE`: with
the default, the residual stream is so small that greedy decoding collapses to one repeated token,
which makes token-for-token comparisons against a reference weak.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvmesh.engine.errors import InvalidParameterError
from kvmesh.models.tokenizer import BOS_TOKEN_ID, EOS_TOKEN_ID, PAD_TOKEN_ID, save_byte_tokenizer

ARCHS: tuple[str, ...] = ("llama", "qwen2", "qwen3", "mistral")
SIZES: tuple[str, ...] = ("test", "bench")
INITIALIZER_RANGE = 0.2


@dataclass(frozen=True)
class TinySize:
    """One row of the benchmark model table (docs/BENCHMARK_SUITE.md), plus Mistral's sliding window
    for that size."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    max_position_embeddings: int
    sliding_window: int


TINY_SIZES: dict[str, TinySize] = {
    # The test window (64) is crossed by prompts of ~100 tokens.
    "test": TinySize(1024, 128, 256, 2, 4, 2, 2048, sliding_window=64),
    "bench": TinySize(32000, 512, 1376, 8, 8, 2, 4096, sliding_window=1024),
}


def tiny_config(arch: str, size: str) -> Any:
    """The transformers config of one tiny checkpoint (InvalidParameterError names a bad field)."""
    if arch not in ARCHS:
        raise InvalidParameterError("arch", f"expected one of {', '.join(ARCHS)}, got {arch!r}")
    if size not in TINY_SIZES:
        raise InvalidParameterError("size", f"expected one of {', '.join(SIZES)}, got {size!r}")
    from transformers import AutoConfig

    dims = TINY_SIZES[size]
    fields: dict[str, Any] = {
        "vocab_size": dims.vocab_size,
        "hidden_size": dims.hidden_size,
        "intermediate_size": dims.intermediate_size,
        "num_hidden_layers": dims.num_hidden_layers,
        "num_attention_heads": dims.num_attention_heads,
        "num_key_value_heads": dims.num_key_value_heads,
        "head_dim": dims.hidden_size // dims.num_attention_heads,
        "max_position_embeddings": dims.max_position_embeddings,
        "tie_word_embeddings": False,
        "initializer_range": INITIALIZER_RANGE,
        "bos_token_id": BOS_TOKEN_ID,
        "eos_token_id": EOS_TOKEN_ID,
        "pad_token_id": PAD_TOKEN_ID,
    }
    if arch == "mistral":
        fields["sliding_window"] = dims.sliding_window
    config = AutoConfig.for_model(arch, **fields)
    config.dtype = "float32"
    return config


def build_tiny_model(out_dir: str | os.PathLike[str], arch: str, size: str, seed: int = 0) -> Path:
    """Write the tiny checkpoint into `out_dir` (created if missing) and return it as a Path.

    Same (arch, size, seed) gives bit-identical weights on the same torch version.
    """
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise InvalidParameterError("seed", f"expected a non-negative int, got {seed!r}")
    config = tiny_config(arch, size)
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config = GenerationConfig(
        bos_token_id=BOS_TOKEN_ID, eos_token_id=EOS_TOKEN_ID, pad_token_id=PAD_TOKEN_ID
    )
    model.save_pretrained(str(out))
    save_byte_tokenizer(out, model_max_length=config.max_position_embeddings)
    return out


def tiny_model_path(size: str = "test") -> Path:
    """The cached tiny Llama of `size` (seed 0), built once (`kvmesh.models.cache.materialize`)."""
    from kvmesh.models.cache import materialize

    tiny_config("llama", size)  # validates `size` before anything is written
    # Bump the version whenever the builder's output changes, so stale caches are not reused.
    name = f"tiny-llama-{size}-seed0-v1"
    return materialize(name, lambda staging: build_tiny_model(staging, "llama", size, 0))
