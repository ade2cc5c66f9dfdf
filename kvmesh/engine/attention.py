"""kvmesh's paged attention, registered in transformers' attention interface.

Each attention layer of a transformers model loaded with `attn_implementation=ATTENTION_NAME`
calls `paged_attention_forward` with its rotary-embedded q/k/v. The function is a thin adapter
onto `kvmesh_kernels`: `write_kv` stores this step's K/V at `slot_mapping`, then
`paged_attention` attends every query token to its sequence's context through the block table
(flat varlen batch; the kernels pick the backend: Triton on CUDA, the fused C++ kernel on CPU).
Per-step metadata travels as the `kvmesh_ctx` keyword argument of the model's forward (no
global state), so several engines can share a process and a thread.

Token batches are flat: the model sees batch size 1 and `num_tokens` positions. transformers
builds no attention mask for this implementation (its name is not in the mask registry).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from kvmesh_kernels import paged_attention, write_kv
from kvmesh_kernels.cache import PagedKVCache

ATTENTION_NAME = "kvmesh_paged"


@dataclass(frozen=True)
class ForwardContext:
    """Attention metadata of one step, shared by every layer (tensors on the cache's device)."""

    kv_cache: PagedKVCache
    slot_mapping: torch.Tensor  # [num_tokens] int64
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32, padded with 0
    seq_lens: torch.Tensor  # [num_seqs] int32, context incl. this step's tokens
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    kvmesh_ctx: ForwardContext | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers attention-interface entry: q [1, Hq, T, D], k/v [1, Hkv, T, D].

    Returns ([1, T, Hq, D], None), the layout transformers' sdpa path returns.
    """
    if kvmesh_ctx is None:
        raise RuntimeError(f"{ATTENTION_NAME} attention needs the kvmesh_ctx forward argument")
    ctx = kvmesh_ctx
    layer = ctx.kv_cache.layer(int(module.layer_idx))  # type: ignore[arg-type]
    q = query[0].transpose(0, 1)  # [T, Hq, D]
    write_kv(layer, key[0].transpose(0, 1), value[0].transpose(0, 1), ctx.slot_mapping)
    out = paged_attention(
        q,
        layer,
        ctx.block_tables,
        ctx.seq_lens,
        ctx.query_start_loc,
        scale=scaling if scaling is not None else q.shape[-1] ** -0.5,
        sliding_window=sliding_window,
    )  # [T, Hq, D]
    return out.unsqueeze(0), None


def register_attention() -> str:
    """Register kvmesh's attention with transformers (idempotent); returns its name."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, paged_attention_forward)
    return ATTENTION_NAME
