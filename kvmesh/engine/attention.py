"""kvmesh's paged attention, registered in transformers' attention interface.

Each attention layer of a transformers model loaded with `attn_implementation=ATTENTION_NAME`
calls `paged_attention_forward` with its rotary-embedded q/k/v. The function stores this step's
K/V into the paged cache at `slot_mapping`, then attends each query token to its sequence's
context read back through the block table. Per-step metadata travels as the `kvmesh_ctx`
keyword argument of the model's forward (no global state), so several engines can share a
process and a thread.

Token batches are flat: the model sees batch size 1 and `num_tokens` positions.

    rows [0, num_decodes)         one query token each, attended in one batched gather
    rows [num_decodes, num_seqs)  prefill chunks, attended one sequence at a time
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from kvmesh_kernels.cache import LayerKV, PagedKVCache

ATTENTION_NAME = "kvmesh_paged"


@dataclass
class ForwardContext:
    """Attention metadata of one step, shared by every layer.

    query_start_loc and seq_lens are Python lists (host-side loop bounds); the tensors live on
    the cache's device. `num_decodes` leading sequences have exactly one query token.
    """

    kv_cache: PagedKVCache
    slot_mapping: torch.Tensor  # [num_tokens] int64
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int64, padded with 0
    query_start_loc: list[int]  # [num_seqs + 1]
    seq_lens: list[int]  # [num_seqs] context incl. this step's tokens
    num_decodes: int
    _decode_masks: dict[int | None, torch.Tensor] = field(default_factory=dict)

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)

    def decode_mask(self, sliding_window: int | None) -> torch.Tensor:
        """[num_decodes, 1, 1, max_len] bool: True where a decode token may attend."""
        mask = self._decode_masks.get(sliding_window)
        if mask is None:
            mask = self._build_decode_mask(sliding_window)
            self._decode_masks[sliding_window] = mask
        return mask

    def _build_decode_mask(self, sliding_window: int | None) -> torch.Tensor:
        device = self.block_tables.device
        block_size = self.kv_cache.spec.block_size
        max_len = int(self.block_tables.shape[1]) * block_size
        lens = torch.tensor(self.seq_lens[: self.num_decodes], device=device)  # [Bd]
        key_pos = torch.arange(max_len, device=device)  # [L]
        mask = key_pos[None, :] < lens[:, None]  # [Bd, L]
        if sliding_window is not None:
            mask &= key_pos[None, :] > (lens[:, None] - 1 - sliding_window)
        return mask[:, None, None, :]


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
    layer = kvmesh_ctx.kv_cache.layer(int(module.layer_idx))  # type: ignore[arg-type]
    q = query[0].transpose(0, 1)  # [T, Hq, D]
    k = key[0].transpose(0, 1)  # [T, Hkv, D]
    v = value[0].transpose(0, 1)  # [T, Hkv, D]
    write_kv(layer, k, v, kvmesh_ctx.slot_mapping)
    scale = scaling if scaling is not None else q.shape[-1] ** -0.5
    out = torch.empty_like(q)  # [T, Hq, D]
    ctx = kvmesh_ctx
    if ctx.num_decodes:
        out[: ctx.num_decodes] = _decode_attention(
            q[: ctx.num_decodes], layer, ctx, scale, sliding_window
        )
    for seq in range(ctx.num_decodes, ctx.num_seqs):
        start, end = ctx.query_start_loc[seq], ctx.query_start_loc[seq + 1]
        out[start:end] = _prefill_attention(
            q[start:end], k[start:end], v[start:end], layer, ctx, seq, scale, sliding_window
        )
    return out.unsqueeze(0), None


def write_kv(layer: LayerKV, key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor) -> None:
    """Store key/value [T, Hkv, D] at slots [T] (unquantized fast path; else the kernel)."""
    if layer.scales is not None:
        from kvmesh_kernels.reference_cache_ops import torch_write_kv

        torch_write_kv(layer, key, value, slots)
        return
    block_size = layer.block_size
    block = torch.div(slots, block_size, rounding_mode="floor")  # [T]
    offset = slots - block * block_size  # [T]
    layer.data[block, 0, offset] = key.to(layer.data.dtype)
    layer.data[block, 1, offset] = value.to(layer.data.dtype)


def _read_blocks(
    layer: LayerKV, block_ids: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gather blocks [..., nb] -> keys, values [..., nb * block_size, Hkv, D] in `dtype`."""
    keys = layer.data[:, 0][block_ids]  # [..., nb, bs, Hkv, D]
    values = layer.data[:, 1][block_ids]
    if layer.scales is not None:
        keys = keys.float() * layer.scales[:, 0][block_ids].unsqueeze(-1)
        values = values.float() * layer.scales[:, 1][block_ids].unsqueeze(-1)
    shape = (*keys.shape[:-4], keys.shape[-4] * keys.shape[-3], *keys.shape[-2:])
    return keys.to(dtype).reshape(shape), values.to(dtype).reshape(shape)


def _decode_attention(
    q: torch.Tensor,
    layer: LayerKV,
    ctx: ForwardContext,
    scale: float,
    sliding_window: int | None,
) -> torch.Tensor:
    """One query token per sequence: q [Bd, Hq, D] -> [Bd, Hq, D]."""
    batch, num_heads, head_dim = q.shape
    keys, values = _read_blocks(layer, ctx.block_tables[:batch], q.dtype)  # [Bd, L, Hkv, D]
    num_kv_heads = keys.shape[-2]
    group = num_heads // num_kv_heads
    keys = keys.permute(0, 2, 3, 1)  # [Bd, Hkv, D, L]
    values = values.transpose(1, 2)  # [Bd, Hkv, L, D]
    q_grouped = q.view(batch, num_kv_heads, group, head_dim)  # [Bd, Hkv, G, D]
    scores = torch.matmul(q_grouped, keys) * scale  # [Bd, Hkv, G, L]
    scores.masked_fill_(~ctx.decode_mask(sliding_window), float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    out = torch.matmul(probs, values)  # [Bd, Hkv, G, D]
    return out.reshape(batch, num_heads, head_dim)


def _prefill_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layer: LayerKV,
    ctx: ForwardContext,
    seq: int,
    scale: float,
    sliding_window: int | None,
) -> torch.Tensor:
    """One sequence's chunk: q [n, Hq, D], its fresh k/v [n, Hkv, D] -> [n, Hq, D]."""
    num_new, context = q.shape[0], ctx.seq_lens[seq]
    start = context - num_new
    window_needed = sliding_window is not None and context > sliding_window
    if start == 0 and layer.scales is None and not window_needed:
        keys, values, mask = k, v, None
    else:
        block_size = layer.block_size
        num_blocks = -(-context // block_size)
        keys, values = _read_blocks(layer, ctx.block_tables[seq, :num_blocks], q.dtype)
        keys, values = keys[:context], values[:context]  # [context, Hkv, D]
        mask = _chunk_mask(start, num_new, context, sliding_window, q.device)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0),  # [1, Hq, n, D]
        keys.transpose(0, 1).unsqueeze(0),  # [1, Hkv, context, D]
        values.transpose(0, 1).unsqueeze(0),
        attn_mask=mask,
        is_causal=mask is None,
        scale=scale,
        enable_gqa=True,
    )  # [1, Hq, n, D]
    return out[0].transpose(0, 1)


def _chunk_mask(
    start: int, num_new: int, context: int, sliding_window: int | None, device: torch.device
) -> torch.Tensor:
    """[n, context] bool: query at position start + i sees keys j <= start + i (within window)."""
    query_pos = torch.arange(start, start + num_new, device=device)[:, None]  # [n, 1]
    key_pos = torch.arange(context, device=device)[None, :]  # [1, context]
    mask = key_pos <= query_pos
    if sliding_window is not None:
        mask &= key_pos > query_pos - sliding_window
    return mask


def register_attention() -> str:
    """Register kvmesh's attention with transformers (idempotent); returns its name."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, paged_attention_forward)
    return ATTENTION_NAME
