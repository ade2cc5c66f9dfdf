"""kvmesh's paged attention, registered in transformers' attention interface.

Each attention layer of a transformers model loaded with `attn_implementation=ATTENTION_NAME`
calls `paged_attention_forward` with its rotary-embedded q/k/v. The function is a thin adapter
onto the step's `kvmesh_kernels.AttentionPlan` (metadata validated and kernel arguments
prepared once per step, not once per layer): `plan.write_kv` stores this step's K/V at
`slot_mapping`, then `plan.attention` attends every query token to its sequence's context
through the block table (flat varlen batch; the plan picks dispatch's backend: Triton on CUDA,
the fused C++ kernel on CPU). Per-step metadata travels as the `kvmesh_ctx` keyword argument of
the model's forward (no global state), so several engines can share a process and a thread.

Token batches are flat: the model sees batch size 1 and `num_tokens` positions. transformers
builds no attention mask for this implementation (its name is not in the mask registry).

    sequences [0, num_paged_seqs)   decodes and chunks with cached context: paged_attention
    the rest (CPU only)             first chunks with no cached context ("fresh"): causal sdpa
                                    on this step's own K/V, one call per sequence

The fresh path exists because the step's K/V are already in hand for those chunks, and
`scaled_dot_product_attention` (flash attention on CPU, AMX in bfloat16) measured 2-3.6x faster
than reading them back through the block table for bfloat16 chunks on a host with AMX; on
others the kernel is faster, so the runner decides which chunks take it by a measurement at
start (`kvmesh.engine.fresh_attention`; BENCHMARKS.md "Implementation choices").
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from kvmesh_kernels.cache import PagedKVCache
from kvmesh_kernels.plan import AttentionPlan

ATTENTION_NAME = "kvmesh_paged"


@dataclass(frozen=True)
class ForwardContext:
    """Attention metadata of one step, shared by every layer (tensors on the cache's device).

    `plan` is built from the other fields when not given (validating them: ValueError on bad
    metadata); the runner builds it and passes the plan's device tensors as the fields.
    """

    kv_cache: PagedKVCache
    slot_mapping: torch.Tensor  # [num_tokens] int64
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32, padded with 0
    seq_lens: torch.Tensor  # [num_seqs] int32, context incl. this step's tokens
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32
    num_paged_seqs: int  # leading sequences attended through the cache
    num_paged_tokens: int  # their tokens (query_start_loc[num_paged_seqs])
    fresh_bounds: tuple[int, ...] = ()  # token bounds of the trailing fresh chunks
    plan: AttentionPlan | None = None

    def __post_init__(self) -> None:
        if self.plan is None:
            plan = AttentionPlan(
                self.kv_cache,
                self.block_tables,
                self.seq_lens,
                self.query_start_loc,
                self.slot_mapping,
            )
            object.__setattr__(self, "plan", plan)

    @property
    def attention_plan(self) -> AttentionPlan:
        """The step's plan (always set after construction)."""
        assert self.plan is not None
        return self.plan

    @property
    def num_seqs(self) -> int:
        return int(self.seq_lens.shape[0])


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
    out = attend(
        kvmesh_ctx,
        int(module.layer_idx),  # type: ignore[arg-type]
        query[0].transpose(0, 1),  # [T, Hq, D]
        key[0].transpose(0, 1),  # [T, Hkv, D]
        value[0].transpose(0, 1),
        scale=scaling if scaling is not None else query.shape[-1] ** -0.5,
        sliding_window=sliding_window,
    )
    return out.unsqueeze(0), None


def attend(
    ctx: ForwardContext,
    layer: int,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    scale: float,
    sliding_window: int | None,
) -> torch.Tensor:
    """Store this step's K/V of `layer` and attend: q [T, Hq, D], k/v [T, Hkv, D] -> [T, Hq, D].

    Every executor's attention layer calls this (transformers' through the adapter above).
    """
    plan = ctx.attention_plan
    plan.write_kv(layer, key, value)
    if not _fresh_path_applies(ctx, ctx.kv_cache.scales is None, sliding_window):
        return plan.attention(query, layer, scale=scale, sliding_window=sliding_window)
    out = torch.empty_like(query)  # [T, Hq, D]
    paged_tokens = ctx.num_paged_tokens
    if ctx.num_paged_seqs:
        out[:paged_tokens] = plan.attention(
            query[:paged_tokens],
            layer,
            scale=scale,
            sliding_window=sliding_window,
            num_seqs=ctx.num_paged_seqs,
        )
    for lo, hi in itertools.pairwise(ctx.fresh_bounds):
        out[lo:hi] = F.scaled_dot_product_attention(
            query[lo:hi].transpose(0, 1).unsqueeze(0),  # [1, Hq, n, D]
            key[lo:hi].transpose(0, 1).unsqueeze(0),  # [1, Hkv, n, D]
            value[lo:hi].transpose(0, 1).unsqueeze(0),
            is_causal=True,
            scale=scale,
            enable_gqa=True,
        )[0].transpose(0, 1)
    return out


def _fresh_path_applies(ctx: ForwardContext, plain_cache: bool, window: int | None) -> bool:
    """Fresh chunks exist, the cache stores K/V unquantized and no window cuts a fresh chunk."""
    if len(ctx.fresh_bounds) < 2 or not plain_cache:
        return False
    if window is None:
        return True
    return max(hi - lo for lo, hi in itertools.pairwise(ctx.fresh_bounds)) <= window


def register_attention() -> str:
    """Register kvmesh's attention with transformers (idempotent); returns its name."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, paged_attention_forward)
    return ATTENTION_NAME
