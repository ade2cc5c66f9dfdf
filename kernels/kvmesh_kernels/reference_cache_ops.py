"""Torch reference for the cache operations: KV write and copy-on-write block copy."""

from __future__ import annotations

from typing import NamedTuple

import torch

from kvmesh_kernels.cache import LayerKV, PagedKVCache, raw_view
from kvmesh_kernels.quant import quantize


class SlotIndex(NamedTuple):
    """Where a token batch lands in the cache: rows [n] of the tokens kept (None when every
    slot is >= 0), their block ids [n] and offsets in the block [n] (int64)."""

    rows: torch.Tensor | None
    block: torch.Tensor
    offset: torch.Tensor


def slot_index(slot_mapping: torch.Tensor, block_size: int) -> SlotIndex:
    """Split slots [num_tokens] (-1 = skip) into kept rows, block ids and offsets."""
    slots = slot_mapping.long()  # [num_tokens]
    rows = None
    if slots.numel() and bool((slots < 0).any()):
        rows = (slots >= 0).nonzero().view(-1)  # [n]
        slots = slots.index_select(0, rows)
    return SlotIndex(rows, slots // block_size, slots % block_size)


def torch_write_kv_at(
    layer: LayerKV, key: torch.Tensor, value: torch.Tensor, index: SlotIndex
) -> None:
    """Store key/value [num_tokens, H, D] at a precomputed `slot_index` (quantizing when the
    layer is int8/fp8)."""
    if index.block.numel() == 0:
        return
    block, offset = index.block, index.offset
    k = key if index.rows is None else key.index_select(0, index.rows)  # [n, H, D]
    v = value if index.rows is None else value.index_select(0, index.rows)  # [n, H, D]
    if layer.scales is None:
        layer.data[block, 0, offset] = k.to(layer.data.dtype)
        layer.data[block, 1, offset] = v.to(layer.data.dtype)
        return
    kq, ks = quantize(k, layer.kv_dtype)  # [n, H, D], [n, H]
    vq, vs = quantize(v, layer.kv_dtype)
    layer.data[block, 0, offset] = kq
    layer.data[block, 1, offset] = vq
    layer.scales[block, 0, offset] = ks
    layer.scales[block, 1, offset] = vs


def torch_write_kv(
    layer: LayerKV, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Store key/value [num_tokens, H, D] at slots [num_tokens] (slot -1 = skip)."""
    torch_write_kv_at(layer, key, value, slot_index(slot_mapping, layer.block_size))


def torch_copy_blocks(cache: PagedKVCache, pairs: torch.Tensor) -> None:
    """For each (src, dst) row of pairs [N, 2], copy block src to dst in all layers."""
    if pairs.numel() == 0:
        return
    src = pairs[:, 0].long()  # [N]
    dst = pairs[:, 1].long()  # [N]
    data = raw_view(cache.data)  # fp8 as uint8: same bytes
    data.index_copy_(0, dst, data.index_select(0, src))
    if cache.scales is not None:
        cache.scales.index_copy_(0, dst, cache.scales.index_select(0, src))
