"""EngineConfig: every knob of one engine, frozen, validated once.

Derived values (number of KV blocks, resolved dtype and device, the scheduler's config) are
returned by functions, never written back here.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvmesh.engine.errors import InvalidParameterError
from kvmesh.engine.scheduler_types import ALLOCATIONS, POLICIES, SCHEDULING_POLICIES

DTYPES = ("auto", "float32", "float16", "bfloat16")
KV_DTYPES = ("auto", "int8", "fp8")
DEVICES = ("auto", "cpu", "cuda")


@dataclass(frozen=True)
class EngineConfig:
    """Configuration of one LLMEngine.

    model: checkpoint folder, .gguf file or cached hub id (`kvmesh.models.resolve`), or None
        for the default model (SmolLM2-135M-Instruct).
    kv_cache_memory: KV pool budget in bytes; None = `memory_utilization` of the device
    (CUDA) or `DEFAULT_CPU_KV_BYTES` on CPU. num_kv_blocks overrides both (tests use it to
    force preemption). max_model_len defaults to the model's max_position_embeddings.
    scheduling_policy: "decode-first" (default; running decodes join every step) or
    "prefill-first" (a step that can do prompt work holds only prompt chunks, for at most
    `max_decode_stall_tokens` prompt tokens while decodes wait); see `kvmesh.engine.scheduler`.
    """

    model: str | None = None
    dtype: str = "auto"
    device: str = "auto"
    kv_dtype: str = "auto"
    block_size: int = 16
    kv_cache_memory: int | None = None
    memory_utilization: float = 0.9
    num_kv_blocks: int | None = None
    max_model_len: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    policy: str = "continuous"
    allocation: str = "paged"
    scheduling_policy: str = "decode-first"
    max_decode_stall_tokens: int = 512
    num_threads: int | None = None
    show_progress: bool = False

    def __post_init__(self) -> None:
        _choice("dtype", self.dtype, DTYPES)
        _choice("kv_dtype", self.kv_dtype, KV_DTYPES)
        _choice("device", self.device, DEVICES)
        _choice("policy", self.policy, POLICIES)
        _choice("allocation", self.allocation, ALLOCATIONS)
        _choice("scheduling_policy", self.scheduling_policy, SCHEDULING_POLICIES)
        for name in (
            "block_size",
            "max_num_seqs",
            "max_num_batched_tokens",
            "max_decode_stall_tokens",
        ):
            _positive(name, getattr(self, name))
        for name in ("kv_cache_memory", "num_kv_blocks", "max_model_len", "num_threads"):
            if getattr(self, name) is not None:
                _positive(name, getattr(self, name))
        if not 0.0 < self.memory_utilization <= 1.0:
            raise InvalidParameterError("memory_utilization", "must be in (0, 1]")


DEFAULT_CPU_KV_BYTES = 1024**3


def _choice(name: str, value: object, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise InvalidParameterError(name, f"must be one of {', '.join(allowed)}; got {value!r}")


def _positive(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise InvalidParameterError(name, f"must be a positive integer; got {value!r}")
