"""Public entry points: validate arguments, then call the torch reference or the Triton kernels.

Backend choice, first match wins: `set_backend(...)`, the environment variable
KVMESH_KERNEL_BACKEND (read once, on first use), else "triton" for CUDA tensors when triton
imports and "torch" otherwise. Triton modules are imported only when that backend runs.
On CPU the "torch" backend runs attention through the fused C++ kernel (`cpu_attention`,
built on first use) when it is available, and KV writes into unquantized caches through the
C copy (`cpu_cache_ops`), else the torch reference; "reference" always runs the torch
reference. KVMESH_CPU_KERNEL=0 turns the C library off.
"""

from __future__ import annotations

import importlib
import operator
import os
from collections.abc import Callable
from typing import Any

import torch

from kvmesh_kernels.cache import HEAD_DIMS, LayerKV, PagedKVCache
from kvmesh_kernels.reference_attention import (
    torch_paged_attention,
    torch_paged_decode_attention,
    torch_paged_prefill_attention,
)
from kvmesh_kernels.reference_cache_ops import torch_copy_blocks, torch_write_kv

BACKENDS = ("torch", "triton", "reference")
ENV_VAR = "KVMESH_KERNEL_BACKEND"
_TRITON_FUNCS = {
    "write_kv": ("kvmesh_kernels.triton_cache_ops", "triton_write_kv"),
    "copy_blocks": ("kvmesh_kernels.triton_cache_ops", "triton_copy_blocks"),
    "decode": ("kvmesh_kernels.triton_attention", "triton_paged_decode_attention"),
    "prefill": ("kvmesh_kernels.triton_attention", "triton_paged_prefill_attention"),
}
_state: dict[str, str | None] = {"override": None, "env": None, "env_read": None}


class BackendUnavailableError(RuntimeError):
    """The requested kernel backend cannot run here (module missing or no CUDA)."""


def set_backend(name: str | None) -> None:
    """Force a backend ("torch", "triton" or "reference") for every call; None restores the
    automatic choice."""
    if name is not None and name not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS} or None, got {name!r}")
    _state["override"] = name


def _env_backend() -> str | None:
    if _state["env_read"] is None:
        value = os.environ.get(ENV_VAR, "").strip().lower() or None
        if value is not None and value not in BACKENDS:
            raise ValueError(f"{ENV_VAR} must be one of {BACKENDS}, got {value!r}")
        _state["env"], _state["env_read"] = value, "yes"
    return _state["env"]


def _triton_importable() -> bool:
    try:
        importlib.import_module("triton")
    except ImportError:
        return False
    return True


def get_backend(device: torch.device) -> str:
    """The backend a call on tensors of `device` would use."""
    chosen = _state["override"] or _env_backend()
    if chosen is not None:
        return chosen
    return "triton" if device.type == "cuda" and _triton_importable() else "torch"


def _triton(op: str) -> Callable[..., Any]:
    module_name, func_name = _TRITON_FUNCS[op]
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise BackendUnavailableError(
            f"triton backend unavailable: cannot import {module_name} ({exc})"
        ) from exc
    func = getattr(module, func_name, None)
    if func is None:
        raise BackendUnavailableError(f"triton backend unavailable: {module_name}.{func_name}")
    return func  # type: ignore[no-any-return]


def _fused_cpu(
    query: torch.Tensor, layer: LayerKV, *, decode: bool = False
) -> Callable[..., torch.Tensor] | None:
    """The fused CPU attention kernel (its decode entry when `decode`) when the torch backend
    can use it here, else None."""
    if query.device.type != "cpu" or get_backend(query.device) != "torch":
        return None
    from kvmesh_kernels import cpu_attention

    if not cpu_attention.supports(query, layer):
        return None
    return cpu_attention.cpu_paged_decode_attention if decode else cpu_attention.cpu_paged_attention


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def _check_attention(
    query: torch.Tensor,
    layer: LayerKV,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None,
) -> None:
    _check_query(query, layer.num_kv_heads, layer.head_dim)
    _check_tables(block_tables, seq_lens)
    _check_scale(scale, sliding_window)


def _check_query(query: torch.Tensor, num_kv_heads: int, head_dim: int) -> None:
    """query [tokens, Hq, D] floating point, D == the cache's head_dim, Hq a multiple of Hkv."""
    _check(
        query.dim() == 3, f"query must be [tokens, num_q_heads, head_dim], got {tuple(query.shape)}"
    )
    _check(query.is_floating_point(), f"query must be floating point, got {query.dtype}")
    _check(query.shape[2] == head_dim, f"query head_dim {query.shape[2]} != cache {head_dim}")
    _check(head_dim in HEAD_DIMS, f"head_dim must be one of {HEAD_DIMS}, got {head_dim}")
    _check(
        query.shape[1] % num_kv_heads == 0,
        f"query num_q_heads {query.shape[1]} not divisible by num_kv_heads {num_kv_heads}",
    )


def _check_tables(block_tables: torch.Tensor, seq_lens: torch.Tensor) -> None:
    """block_tables [batch, max_blocks] int32/int64 and seq_lens [batch]."""
    _check(
        block_tables.dim() == 2 and block_tables.dtype in (torch.int32, torch.int64),
        "block_tables must be [batch, max_blocks] int32",
    )
    _check(
        seq_lens.dim() == 1 and seq_lens.shape[0] == block_tables.shape[0],
        "seq_lens must be [batch] matching block_tables",
    )


def _check_scale(scale: float, sliding_window: int | None) -> None:
    _check(scale > 0, f"scale must be positive, got {scale}")
    _check(
        sliding_window is None or sliding_window > 0,
        f"sliding_window must be None or positive, got {sliding_window}",
    )


def _check_lengths(
    block_tables: torch.Tensor, seq_lens: torch.Tensor, block_size: int, q_lens: list[int] | None
) -> None:
    """Host-side checks (they synchronize, so only the torch path runs them)."""
    _check_host_lengths(seq_lens.tolist(), block_tables.shape[1] * block_size, q_lens)


def _check_host_lengths(lens: list[int], capacity: int, q_lens: list[int] | None) -> None:
    """Every context fits its table row (capacity tokens); every chunk fits its context."""
    _check(
        not lens or (min(lens) >= 0 and max(lens) <= capacity),
        f"seq_lens must lie in [0, max_blocks * block_size = {capacity}]",
    )
    if q_lens is not None:
        _check(
            len(q_lens) == len(lens)
            and (not q_lens or min(q_lens) >= 0)
            and all(map(operator.le, q_lens, lens)),
            "query_start_loc gives a query chunk longer than its seq_lens context",
        )


def _q_lens(
    query: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor
) -> list[int]:
    return _host_q_lens(query.shape[0], seq_lens.shape[0], query_start_loc)


def _host_q_lens(num_tokens: int | None, batch: int, query_start_loc: torch.Tensor) -> list[int]:
    """Chunk lengths from query_start_loc [batch + 1], which must run 0..num_tokens upward
    (num_tokens None: to its own last entry)."""
    _check(
        query_start_loc.dim() == 1 and query_start_loc.shape[0] == batch + 1,
        "query_start_loc must be [batch + 1]",
    )
    starts = query_start_loc.tolist()
    if num_tokens is None:
        num_tokens = starts[-1]
    _check(
        starts[0] == 0 and starts[-1] == num_tokens,
        f"query_start_loc must run from 0 to num_tokens={num_tokens}",
    )
    q_lens = list(map(operator.sub, starts[1:], starts[:-1]))
    _check(not q_lens or min(q_lens) >= 0, "query_start_loc must be non-decreasing")
    return q_lens


def _check_kv(key: torch.Tensor, value: torch.Tensor, num_kv_heads: int, head_dim: int) -> None:
    """key and value [num_tokens, Hkv, D], the same shape."""
    shape = (num_kv_heads, head_dim)
    _check(
        key.dim() == 3 and tuple(key.shape[1:]) == shape,
        f"key must be [num_tokens, {shape[0]}, {shape[1]}], got {tuple(key.shape)}",
    )
    _check(value.shape == key.shape, f"value shape {tuple(value.shape)} != key {tuple(key.shape)}")


def _check_slots(slot_mapping: torch.Tensor, num_tokens: int) -> None:
    """slot_mapping [num_tokens], an integer tensor."""
    _check(
        slot_mapping.dim() == 1 and slot_mapping.shape[0] == num_tokens,
        f"slot_mapping must be [num_tokens={num_tokens}], got {tuple(slot_mapping.shape)}",
    )
    _check(not slot_mapping.is_floating_point(), "slot_mapping must be an integer tensor")


def _check_slot_range(slot_mapping: torch.Tensor, total: int) -> None:
    """Every slot in [-1, total) (host-side: synchronizes)."""
    if slot_mapping.numel():
        low, high = torch.aminmax(slot_mapping)
        _check(int(high) < total and int(low) >= -1, f"slot_mapping must lie in [-1, {total})")


def write_kv(
    layer: LayerKV, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Store key/value [num_tokens, num_kv_heads, head_dim] at slot_mapping [num_tokens] int64
    (slot = block_id * block_size + offset; -1 skips the token). Quantizes when the layer is."""
    _check_kv(key, value, layer.num_kv_heads, layer.head_dim)
    _check_slots(slot_mapping, key.shape[0])
    backend = get_backend(key.device)
    if backend == "triton":
        _triton("write_kv")(layer, key, value, slot_mapping)
        return
    if backend == "torch" and key.device.type == "cpu":
        from kvmesh_kernels import cpu_cache_ops

        if cpu_cache_ops.supports_write(layer, key, value):
            cpu_cache_ops.cpu_write_kv(layer, key, value, slot_mapping)  # checks the range
            return
    _check_slot_range(slot_mapping, layer.data.shape[0] * layer.block_size)
    torch_write_kv(layer, key, value, slot_mapping)


def copy_blocks(cache: PagedKVCache, pairs: torch.Tensor) -> None:
    """Copy block src to dst for each row (src, dst) of pairs [N, 2] int64, all layers and
    scales. Destinations must be distinct and not also sources."""
    _check(
        pairs.dim() == 2 and pairs.shape[1] == 2, f"pairs must be [N, 2], got {tuple(pairs.shape)}"
    )
    if get_backend(cache.data.device) == "triton":
        _triton("copy_blocks")(cache, pairs)
        return
    if pairs.numel():
        _check(
            int(pairs.min()) >= 0 and int(pairs.max()) < cache.spec.num_blocks,
            f"pairs must hold block ids in [0, {cache.spec.num_blocks})",
        )
    torch_copy_blocks(cache, pairs)


def paged_decode_attention(
    query: torch.Tensor,
    layer: LayerKV,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    scale: float,
    sliding_window: int | None = None,
    num_splits: int | None = None,
) -> torch.Tensor:
    """One query token per sequence: query [batch, Hq, D] is the last token of its seq_lens[b]
    context (block_tables [batch, max_blocks] int32). Returns [batch, Hq, D] in query.dtype;
    an empty context (seq_len 0) gives zeros."""
    _check_attention(query, layer, block_tables, seq_lens, scale, sliding_window)
    _check(query.shape[0] == seq_lens.shape[0], "query must have one row per sequence (batch)")
    func: Callable[..., torch.Tensor] = torch_paged_decode_attention
    if get_backend(query.device) == "triton":
        func = _triton("decode")
    else:
        _check_lengths(block_tables, seq_lens, layer.block_size, None)
        func = _fused_cpu(query, layer, decode=True) or func
    return func(
        query,
        layer,
        block_tables,
        seq_lens,
        scale=scale,
        sliding_window=sliding_window,
        num_splits=num_splits,
    )


def paged_prefill_attention(
    query: torch.Tensor,
    layer: LayerKV,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    *,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Varlen chunks: query [num_tokens, Hq, D]; sequence b owns rows
    query_start_loc[b]:query_start_loc[b+1], the LAST q_len tokens of its seq_lens[b]-token
    context, and attends causally to its whole context (already written to the cache)."""
    _check_attention(query, layer, block_tables, seq_lens, scale, sliding_window)
    if get_backend(query.device) == "triton":
        return _triton("prefill")(  # type: ignore[no-any-return]
            query,
            layer,
            block_tables,
            seq_lens,
            query_start_loc,
            scale=scale,
            sliding_window=sliding_window,
        )
    q_lens = _q_lens(query, seq_lens, query_start_loc)
    _check_lengths(block_tables, seq_lens, layer.block_size, q_lens)
    func = _fused_cpu(query, layer) or torch_paged_prefill_attention
    return func(
        query,
        layer,
        block_tables,
        seq_lens,
        query_start_loc,
        scale=scale,
        sliding_window=sliding_window,
    )


def paged_attention(
    query: torch.Tensor,
    layer: LayerKV,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    *,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Mixed decode + prefill batch in one call, same contract as paged_prefill_attention
    (decode rows have q_len 1). Every sequence must have q_len >= 1, so a batch with
    num_tokens == batch is all decode (the Triton path relies on this without a host sync)."""
    _check_attention(query, layer, block_tables, seq_lens, scale, sliding_window)
    batch = seq_lens.shape[0]
    if get_backend(query.device) == "triton":
        if query.shape[0] == batch:
            return _triton("decode")(  # type: ignore[no-any-return]
                query, layer, block_tables, seq_lens, scale=scale, sliding_window=sliding_window
            )
        return _triton("prefill")(  # type: ignore[no-any-return]
            query,
            layer,
            block_tables,
            seq_lens,
            query_start_loc,
            scale=scale,
            sliding_window=sliding_window,
        )
    q_lens = _q_lens(query, seq_lens, query_start_loc)
    _check(all(q >= 1 for q in q_lens), "paged_attention needs q_len >= 1 for every sequence")
    _check_lengths(block_tables, seq_lens, layer.block_size, q_lens)
    func = _fused_cpu(query, layer) or torch_paged_attention
    return func(
        query,
        layer,
        block_tables,
        seq_lens,
        query_start_loc,
        scale=scale,
        sliding_window=sliding_window,
    )
