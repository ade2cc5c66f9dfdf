"""Triton paged attention entry points (decode and prefill/extend) over a `LayerKV`.

Same contracts as `kvmesh_kernels.dispatch` (which validates arguments first); these launchers
never synchronize with the host. Kernels read the per-layer view through its strides (the
view is not contiguous across blocks) with int64 block offsets, accumulate in float32 and
dequantize int8/fp8 caches inside the kernel. Off CUDA they run under TRITON_INTERPRET=1 with
small tiles. `out`, when given, receives the result and is returned.
"""

from __future__ import annotations

import torch

from kvmesh_kernels.cache import LayerKV
from kvmesh_kernels.triton_decode import choose_num_splits, launch_decode, sm_count
from kvmesh_kernels.triton_prefill import launch_prefill


def _prepare(
    query: torch.Tensor, layer: LayerKV, out: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Query with a unit last stride, and the output buffer (checked or fresh)."""
    if layer.data.stride(-1) != 1:
        raise ValueError("the cache's head_dim axis must be contiguous")
    if query.stride(-1) != 1:
        query = query.contiguous()
    if out is None:
        return query, torch.empty_like(query)
    if out.shape != query.shape or out.dtype != query.dtype or out.stride(-1) != 1:
        raise ValueError(f"out must be {tuple(query.shape)} {query.dtype} with unit last stride")
    return query, out


def triton_paged_decode_attention(
    query: torch.Tensor,
    layer: LayerKV,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    scale: float,
    sliding_window: int | None = None,
    num_splits: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """query [batch, Hq, D] (the last token of each seq_lens[b] context) -> [batch, Hq, D].

    `num_splits` None picks split-K from batch x kv heads vs the SM count; 1 disables it.
    """
    query, out = _prepare(query, layer, out)
    batch = query.shape[0]
    if batch == 0:
        return out
    if num_splits is None:
        context = block_tables.shape[1] * layer.block_size
        if sliding_window is not None:
            context = min(context, sliding_window)
        num_splits = choose_num_splits(batch, layer.num_kv_heads, context, sm_count(query.device))
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    launch_decode(
        query,
        layer.data,
        layer.scales,
        block_tables,
        seq_lens,
        out,
        scale,
        sliding_window or 0,
        num_splits,
        interpreted=query.device.type != "cuda",
    )
    return out


def triton_paged_prefill_attention(
    query: torch.Tensor,
    layer: LayerKV,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    *,
    scale: float,
    sliding_window: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Flat varlen query [num_tokens, Hq, D]; rows query_start_loc[b]:query_start_loc[b+1] are
    the last q_len tokens of sequence b and attend causally to its cached context and
    themselves. Returns [num_tokens, Hq, D]."""
    query, out = _prepare(query, layer, out)
    launch_prefill(
        query,
        layer.data,
        layer.scales,
        block_tables,
        seq_lens,
        query_start_loc,
        out,
        scale,
        sliding_window or 0,
        interpreted=query.device.type != "cuda",
    )
    return out
