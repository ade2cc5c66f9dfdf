"""Torch reference for the cache operations: KV write and copy-on-write block copy."""

from __future__ import annotations

import torch

from kvmesh_kernels.cache import LayerKV, PagedKVCache, raw_view
from kvmesh_kernels.quant import quantize


def torch_write_kv(
    layer: LayerKV, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Store key/value [num_tokens, H, D] at slots [num_tokens] (slot -1 = skip)."""
    block_size = layer.block_size
    keep = slot_mapping >= 0  # [num_tokens]
    slots = slot_mapping[keep].long()  # [n]
    if slots.numel() == 0:
        return
    block = slots // block_size  # [n]
    offset = slots % block_size  # [n]
    k = key[keep]  # [n, H, D]
    v = value[keep]  # [n, H, D]
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
