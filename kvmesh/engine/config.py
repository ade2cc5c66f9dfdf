"""EngineConfig: every knob of one engine, frozen, validated once.

Derived values (number of KV blocks, resolved dtype and device, the scheduler's config) are
returned by functions, never written back here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvmesh.engine.errors import InvalidParameterError
from kvmesh.engine.scheduler.config import ALLOCATIONS, POLICIES, SCHEDULING_POLICIES

DTYPES = ("auto", "float32", "float16", "bfloat16")
KV_DTYPES = ("auto", "int8", "fp8")
DEVICES = ("auto", "cpu", "cuda")
EXECUTORS = ("auto", "native", "transformers")
FLOAT32_PACKINGS = ("auto", "on", "off")
CPU_GEMMS = ("auto", "kvmesh", "torch")
FRESH_ATTENTION_MODES = ("auto", "on", "off")
COMPILE_MODES = ("off", "on")
PREEMPTIONS = ("auto", "swap", "recompute")


def _setting(default: Any, help: str, choices: tuple[str, ...] | None = None) -> Any:
    """A field with its one default, its help text and (optionally) its allowed values: what
    the command-line flags are generated from (`kvmesh.service.engine_flags`)."""
    return field(default=default, metadata={"help": help, "choices": choices})


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
    Each field's metadata holds its help text and choices.
    """

    model: str | None = _setting(
        None, "checkpoint folder, .gguf file or hub id Org/Name (default: SmolLM2-135M-Instruct)"
    )
    dtype: str = _setting("auto", "weight and activation dtype", DTYPES)
    device: str = _setting("auto", "where the engine runs", DEVICES)
    executor: str = _setting(
        "auto",
        "model code: native (kvmesh's Llama-family executor), transformers, or auto "
        "(native when the architecture is covered)",
        EXECUTORS,
    )
    kv_dtype: str = _setting("auto", "KV cache storage dtype (auto: the model's)", KV_DTYPES)
    float32_packing: str = _setting(
        "auto",
        "native executor, float32 on CPU: oneDNN-packed linears (on), MKL's F.linear (off), or "
        "auto (packed when a load-time measurement finds it 10 percent faster)",
        FLOAT32_PACKINGS,
    )
    cpu_gemm: str = _setting(
        "auto",
        "native executor on CPU: kvmesh's GEMM for the linears, which prefetches the weights "
        "decode steps stream (kvmesh; float32 needs AVX2 + FMA or AVX-512, bfloat16 "
        "AVX512_BF16), torch's "
        "(oneDNN-packed; float32 as float32_packing says), or auto (kvmesh where the CPU runs "
        "it for the model's dtype and has no AMX, against which it was not measured)",
        CPU_GEMMS,
    )
    fresh_attention: str = _setting(
        "auto",
        "CPU: first prefill chunks attend by causal sdpa on their own K/V (on), through the "
        "paged kernel (off), or auto (sdpa from the probe length on which a start-time "
        "measurement at the model's heads finds it 10 percent faster; a step goes by its "
        "longest first chunk)",
        FRESH_ATTENTION_MODES,
    )
    compile: str = _setting(
        "off",
        "native executor: torch.compile (inductor) of the per-layer math around attention "
        "(on; compiles during warm-up) or eager with the fused kernels (off)",
        COMPILE_MODES,
    )
    cuda_graphs: bool = _setting(
        True,
        "CUDA, native executor: decode steps replay CUDA graphs captured at start for "
        "batch-size buckets up to max_num_seqs (prompt and mixed steps run eagerly)",
    )
    decode_program: bool = _setting(
        True,
        "CPU, native executor: decode steps, and mixed steps of up to max(max_num_seqs, "
        "512) tokens in which every sequence attends through the cache, replay the step's "
        "kernel calls recorded once at start (one call from Python per step instead of about "
        "ten per layer; the same kernels and results); other steps run eagerly",
    )
    block_size: int = _setting(16, "tokens per KV block")
    kv_cache_memory: int | None = _setting(
        None, "KV pool budget in bytes: 512MiB, 8GiB or 8Gi (binary), 8GB or 8G (decimal)"
    )
    memory_utilization: float = _setting(0.9, "fraction of GPU memory for weights and KV")
    num_kv_blocks: int | None = _setting(None, "exact KV pool size in blocks (overrides budgets)")
    max_model_len: int | None = _setting(None, "longest sequence (default: the model's)")
    max_num_seqs: int = _setting(256, "most sequences in one step")
    max_num_batched_tokens: int = _setting(2048, "most tokens in one step")
    enable_chunked_prefill: bool = _setting(True, "split long prompts over several steps")
    long_prefill_token_threshold: int | None = _setting(
        None,
        "chunked prefill: most prompt tokens of one sequence in one step (default: the budget)",
    )
    enable_prefix_caching: bool = _setting(True, "reuse cached KV blocks of equal prefixes")
    policy: str = _setting("continuous", "batching (static: a benchmark baseline)", POLICIES)
    allocation: str = _setting("paged", "KV allocation (contiguous: a baseline)", ALLOCATIONS)
    scheduling_policy: str = _setting(
        "decode-first",
        "decode-first: running decodes join every step; prefill-first: a step that can do "
        "prompt work runs only prompt chunks (bounded decode stall)",
        SCHEDULING_POLICIES,
    )
    max_decode_stall_tokens: int = _setting(512, "prefill-first: prompt tokens decodes may wait")
    host_kv_gib: float | None = _setting(
        None, "host-memory KV tier below the device cache, GiB (pinned on CUDA; default: none)"
    )
    disk_kv_dir: str | None = _setting(
        None,
        "folder of the disk KV tier below the host tier (which defaults to 1 GiB when "
        "--host-kv-gib is not set)",
    )
    disk_kv_gib: float = _setting(4.0, "disk KV tier capacity, GiB")
    disk_kv_persist: bool = _setting(
        False, "keep (and verify) the disk tier's blocks across restarts"
    )
    preemption: str = _setting(
        "auto",
        "preempted sequences: swap (to the host tier), recompute, or auto (by estimated "
        "cost); without a host tier always recompute",
        PREEMPTIONS,
    )
    num_threads: int | None = _setting(None, "torch CPU threads (default: torch's)")
    generation_config: str = _setting(
        "auto",
        "default sampling: auto (the model's generation_config.json, as vLLM), vllm (neutral "
        "defaults) or a folder holding a generation_config.json",
    )
    show_progress: bool = _setting(False, "print the KV capacity line at start")

    def __post_init__(self) -> None:
        _choice("dtype", self.dtype, DTYPES)
        _choice("kv_dtype", self.kv_dtype, KV_DTYPES)
        _choice("device", self.device, DEVICES)
        _choice("executor", self.executor, EXECUTORS)
        _choice("float32_packing", self.float32_packing, FLOAT32_PACKINGS)
        _choice("cpu_gemm", self.cpu_gemm, CPU_GEMMS)
        _choice("fresh_attention", self.fresh_attention, FRESH_ATTENTION_MODES)
        _choice("compile", self.compile, COMPILE_MODES)
        _choice("policy", self.policy, POLICIES)
        _choice("allocation", self.allocation, ALLOCATIONS)
        _choice("scheduling_policy", self.scheduling_policy, SCHEDULING_POLICIES)
        _choice("preemption", self.preemption, PREEMPTIONS)
        self._check_tiers()
        for name in (
            "block_size",
            "max_num_seqs",
            "max_num_batched_tokens",
            "max_decode_stall_tokens",
        ):
            _positive(name, getattr(self, name))
        optional = ("kv_cache_memory", "num_kv_blocks", "max_model_len", "num_threads",
                    "long_prefill_token_threshold")  # fmt: skip
        for name in optional:
            if getattr(self, name) is not None:
                _positive(name, getattr(self, name))
        if not isinstance(self.generation_config, str) or not self.generation_config:
            raise InvalidParameterError("generation_config", "must be auto, vllm or a folder")
        if not 0.0 < self.memory_utilization <= 1.0:
            raise InvalidParameterError("memory_utilization", "must be in (0, 1]")
        if self.num_threads is not None and self.num_threads > MAX_NUM_THREADS:
            raise InvalidParameterError(  # torch starts one OS thread each: far more crashes it
                "num_threads", f"must be at most {MAX_NUM_THREADS}; got {self.num_threads}"
            )

    def _check_tiers(self) -> None:
        for name in ("host_kv_gib", "disk_kv_gib"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not value > 0):
                raise InvalidParameterError(name, f"must be a positive number; got {value!r}")


DEFAULT_CPU_KV_BYTES = 1024**3
MAX_NUM_THREADS = 1024
DEFAULT_HOST_KV_GIB = 1.0  # the host tier under a disk tier when host_kv_gib is not set


def _choice(name: str, value: object, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise InvalidParameterError(name, f"must be one of {', '.join(allowed)}; got {value!r}")


def _positive(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise InvalidParameterError(name, f"must be a positive integer; got {value!r}")
