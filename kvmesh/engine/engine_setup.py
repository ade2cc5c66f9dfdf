"""Build an engine's parts from an EngineConfig: model, KV pool sized by budget, scheduler.

KV pool size: `num_kv_blocks` if given, else the memory planner over a budget of
`kv_cache_memory` bytes (or, on CUDA, `memory_utilization` of the device minus the weights;
on CPU `DEFAULT_CPU_KV_BYTES`).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from dataclasses import dataclass, replace
from types import MappingProxyType
from typing import Any

import torch

from kvmesh.engine.config import DEFAULT_CPU_KV_BYTES, DEFAULT_HOST_KV_GIB, EngineConfig
from kvmesh.engine.errors import InvalidParameterError
from kvmesh.engine.generation_defaults import sampling_defaults
from kvmesh.engine.host_memory import host_available_bytes
from kvmesh.engine.loader import LoadedModel, load_model
from kvmesh.engine.native.rope import rope_params, rope_type
from kvmesh.engine.runner import ModelRunner, kv_cache_spec
from kvmesh.engine.sampler import Sampler
from kvmesh.engine.scheduler import Scheduler, SchedulerConfig
from kvmesh.memory import BlockManager
from kvmesh.memory.planner import KVModelShape, plan_kv_capacity
from kvmesh.memory.tiers.build import (
    GIB,
    TierSettings,
    build_store,
    checkpoint_identity,
    persistent_seed,
)
from kvmesh.memory.tiers.store import TieredStore

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineParts:
    """Everything an LLMEngine drives, built once."""

    loaded: LoadedModel
    runner: ModelRunner
    scheduler: Scheduler
    sampler: Sampler
    max_model_len: int
    eos_token_id: int | None  # the first of eos_token_ids (ModelInfo's one id)
    tiers: TieredStore | None = None
    eos_token_ids: tuple[int, ...] = ()  # every EOS id: each stops and is masked by min_tokens
    # the model's default sampling (`generation_defaults`): unset request fields take these
    sampling_defaults: Mapping[str, Any] = dataclasses.field(
        default_factory=lambda: MappingProxyType({})
    )

    def capacity_line(self) -> str:
        """Start-up summary: blocks, tokens, max concurrency at max model length."""
        spec = self.runner.kv_cache.spec
        tokens = spec.num_blocks * spec.block_size
        per_seq = -(-self.max_model_len // spec.block_size)
        mib = spec.num_blocks * spec.bytes_per_block / 2**20
        return (
            f"kvmesh: KV cache {spec.num_blocks} blocks x {spec.block_size} tokens = {tokens} "
            f"tokens ({mib:.1f} MiB, {spec.kv_dtype}); max concurrency at "
            f"{self.max_model_len} tokens: {spec.num_blocks // per_seq}"
        )


def build_engine_parts(config: EngineConfig) -> EngineParts:
    if config.num_threads is not None:
        torch.set_num_threads(config.num_threads)
    loaded = load_model(config)
    max_model_len = resolve_max_model_len(config, loaded.hf_config)
    num_blocks = plan_num_blocks(config, loaded, max_model_len)
    if loaded.device.type == "cpu":  # the pool is faulted in at start: it must fit in RAM
        spec = kv_cache_spec(
            loaded.hf_config, num_blocks, config.block_size, loaded.dtype, config.kv_dtype
        )
        field = "num_kv_blocks" if config.num_kv_blocks is not None else "kv_cache_memory"
        check_host_memory(num_blocks * spec.bytes_per_block, field, "the KV cache")
    max_blocks = -(-max_model_len // config.block_size)
    runner = ModelRunner(
        loaded, num_blocks, config.block_size, config.kv_dtype, max_blocks, config.fresh_attention
    )
    if config.cuda_graphs and loaded.device.type == "cuda" and loaded.executor == "native":
        runner.enable_decode_graphs(config.max_num_seqs)
    if config.decode_program and loaded.device.type == "cpu" and config.compile == "off":
        reason = runner.enable_decode_program(config.max_num_seqs, config.max_num_batched_tokens)
        logger.info("CPU step program: %s", "on" if reason is None else f"off ({reason})")
    eos = eos_token_ids(loaded, runner.vocab_size)
    scheduler_config = SchedulerConfig(
        max_model_len=max_model_len,
        max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens,
        enable_chunked_prefill=config.enable_chunked_prefill,
        long_prefill_token_threshold=config.long_prefill_token_threshold,
        enable_prefix_caching=config.enable_prefix_caching,
        policy=config.policy,
        allocation=config.allocation,
        scheduling_policy=config.scheduling_policy,
        max_decode_stall_tokens=config.max_decode_stall_tokens,
        preemption=config.preemption,
        eos_token_ids=eos,
    )
    model_id = checkpoint_identity(loaded.path)  # keys the tiers' KV to these very weights
    tiers = build_tiers(config, runner, model_id)
    block_manager = BlockManager(
        num_blocks,
        config.block_size,
        enable_prefix_caching=config.enable_prefix_caching,
        hash_seed=None if tiers is None else persistent_seed(tiers, model_id),
        tiers=tiers,
    )
    scheduler = Scheduler(scheduler_config, block_manager)
    first = eos[0] if eos else None
    generation = getattr(loaded.model, "generation_config", None)
    defaults = sampling_defaults(config.generation_config, generation)
    return EngineParts(
        loaded, runner, scheduler, Sampler(), max_model_len, first, tiers, eos, defaults
    )


def build_tiers(config: EngineConfig, runner: ModelRunner, model_id: str) -> TieredStore | None:
    """The host/disk tiers of `config` (None with neither host_kv_gib nor disk_kv_dir)."""
    if config.host_kv_gib is None and config.disk_kv_dir is None:
        return None
    settings = TierSettings(
        int((config.host_kv_gib or DEFAULT_HOST_KV_GIB) * GIB),
        config.disk_kv_dir,
        int(config.disk_kv_gib * GIB),
        config.disk_kv_persist,
    )
    check_host_memory(settings.host_bytes, "host_kv_gib", "the host KV tier")
    try:
        return build_store(runner.kv_cache, settings, model_id)
    except ValueError as exc:
        text = str(exc)
        field = "host_kv_gib"
        if "disk" in text:
            field = "disk_kv_dir" if "folder" in text else "disk_kv_gib"
        raise InvalidParameterError(field, text) from None


def check_host_memory(nbytes: int, field: str, what: str) -> None:
    """InvalidParameterError naming `field` when `nbytes` of host memory are more than the host
    has available now (what vLLM's CPU worker refuses too): the process stops at start rather
    than failing to allocate, or being killed for memory once the pages are touched."""
    available = host_available_bytes()
    if available is not None and nbytes > available:
        raise InvalidParameterError(
            field,
            f"{what} needs {nbytes / GIB:.2f} GiB but the host has {available / GIB:.2f} GiB of "
            "memory available; lower it",
        )


def resolve_max_model_len(config: EngineConfig, hf_config: Any) -> int:
    limit, why = position_limit(hf_config)
    if config.max_model_len is None:
        if limit is None:
            raise InvalidParameterError("max_model_len", "the model config names none; set it")
        if why:
            logger.info("max_model_len %d: %s", limit, why)
        return int(limit)
    if limit is not None and config.max_model_len > limit:
        raise InvalidParameterError(
            "max_model_len",
            f"{config.max_model_len} exceeds the model's {limit} positions"
            + (f" ({why})" if why else ""),
        )
    return config.max_model_len


def position_limit(hf_config: Any) -> tuple[int | None, str]:
    """The positions the engine serves the model at, and why when that is not the config's
    max_position_embeddings. `longrope` stops at its original context: transformers rotates
    every position of a forward call with the long factors once the call's highest position
    passes it, so a step holding several sequences, or one chunk of a prompt, would rotate
    some of them otherwise than `generate` does for each alone."""
    limit = getattr(hf_config, "max_position_embeddings", None)
    if rope_type(hf_config) != "longrope":
        return limit, ""
    original = rope_params(hf_config).get("original_max_position_embeddings") or getattr(
        hf_config, "original_max_position_embeddings", None
    )
    if original is None:
        raise InvalidParameterError(
            "max_model_len", "a longrope config without original_max_position_embeddings"
        )
    why = "longrope is served within its original context (original_max_position_embeddings)"
    return int(original) if limit is None else min(int(original), int(limit)), why


def plan_num_blocks(config: EngineConfig, loaded: LoadedModel, max_model_len: int) -> int:
    if config.num_kv_blocks is not None:
        return config.num_kv_blocks
    shape = KVModelShape.from_config(loaded.path)
    dtype_name = str(loaded.dtype).removeprefix("torch.")
    shape = replace(shape, dtype=dtype_name)
    if config.kv_cache_memory is not None or loaded.device.type != "cuda":
        memory, utilization, weights = config.kv_cache_memory or DEFAULT_CPU_KV_BYTES, 1.0, 0
    else:
        memory = torch.cuda.get_device_properties(loaded.device).total_memory
        utilization = config.memory_utilization
        weights = sum(p.numel() * p.element_size() for p in loaded.model.parameters())
    plan = plan_kv_capacity(
        shape,
        memory_bytes=memory,
        utilization=utilization,
        weights_bytes=weights,
        block_size=config.block_size,
        kv_dtype=config.kv_dtype,
        max_model_len=max_model_len,
    )
    if plan.num_blocks < 1:
        raise InvalidParameterError("kv_cache_memory", "budget holds no KV block")
    needed = -(-max_model_len // config.block_size)
    if plan.num_blocks < needed:  # as vLLM: every request up to the context would be refused
        by_device = config.kv_cache_memory is None and loaded.device.type == "cuda"
        field = "memory_utilization" if by_device else "kv_cache_memory"
        raise InvalidParameterError(
            field,
            f"the KV budget holds {plan.num_blocks} blocks ({plan.token_capacity} tokens), "
            f"fewer than the {needed} one sequence of max_model_len {max_model_len} needs; "
            "raise it or lower --max-model-len",
        )
    return plan.num_blocks


def eos_token_ids(loaded: LoadedModel, vocab_size: int) -> tuple[int, ...]:
    """Every end-of-sequence id of the model, as vLLM honours them: generation_config's (one id
    or a list, e.g. Llama-3 Instruct's end of text, of message and of turn), then config.json's
    not already named; ids outside the vocabulary are left out. () when neither names one."""
    generation = getattr(loaded.model, "generation_config", None)
    found: list[int] = []
    for source in (generation, loaded.hf_config):
        eos = getattr(source, "eos_token_id", None)
        for token in eos if isinstance(eos, (list, tuple)) else (eos,):
            if token is not None and 0 <= int(token) < vocab_size and int(token) not in found:
                found.append(int(token))
    return tuple(found)
