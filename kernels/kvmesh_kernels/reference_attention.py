"""Torch reference for paged attention (decode and prefill/extend), efficient enough to serve on
CPU: each call gathers only the blocks it needs with one `index_select` per K and V into a
contiguous buffer, then runs one batched `scaled_dot_product_attention`.

GQA is handled without repeating K/V: the `G = num_q_heads // num_kv_heads` query heads that
share a kv head are folded into the query-length axis, e.g. decode runs
`q [batch, Hkv, G, D] x k [batch, Hkv, T, D]`.

Masks follow transformers exactly: a query at position p sees key positions t with t <= p and,
with a sliding window w, t > p - w (w keys including itself). Sequences with an empty context
produce zeros.
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F

from kvmesh_kernels.cache import LayerKV, raw_view
from kvmesh_kernels.quant import dequantize

# Reused gather buffers, one per (device, dtype): fresh multi-megabyte allocations on every
# call cost more in page faults than the copy itself. Not thread-safe (one engine thread).
_WORKSPACE: dict[tuple[str, torch.dtype, bool], torch.Tensor] = {}


def _workspace(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A reused buffer of at least `numel` elements, one per device, dtype and inference mode
    (a buffer made under `torch.inference_mode` cannot be written outside it)."""
    key = (str(device), dtype, torch.is_inference_mode_enabled())
    buf = _WORKSPACE.get(key)
    if buf is None or buf.numel() < numel:
        buf = torch.empty(numel, dtype=dtype, device=device)
        _WORKSPACE[key] = buf
    return buf[:numel]


def gather_context(
    layer: LayerKV, block_ids: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of the blocks block_ids [batch, n] as [batch, n * block_size, H, D] in dtype.

    The results may be views of a reused workspace: valid until the next gather.
    """
    batch, n = block_ids.shape
    ids = block_ids.reshape(-1).long().clamp_(0, layer.data.shape[0] - 1)  # [batch * n]
    block_shape = layer.data.shape[2:]  # [block_size, H, D]
    numel = ids.numel() * block_shape.numel()
    plain = layer.scales is None and layer.data.dtype == dtype
    buf = _workspace(2 * numel, dtype, layer.data.device) if plain else None
    out = []
    for kv in (0, 1):
        src = layer.data[:, kv]  # [num_blocks, block_size, H, D]
        if buf is not None:
            x = buf[kv * numel : (kv + 1) * numel].view(ids.numel(), *block_shape)
            torch.index_select(src, 0, ids, out=x)
        else:
            x = raw_view(src).index_select(0, ids).view(src.dtype)
            if layer.scales is not None:
                s = layer.scales[:, kv].index_select(0, ids)  # [batch * n, block_size, H]
                x = dequantize(x, s, dtype)
            x = x.to(dtype)
        out.append(x.view(batch, n * layer.block_size, *block_shape[1:]))
    return out[0], out[1]


def key_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, sliding_window: int | None) -> torch.Tensor:
    """Visibility q_pos [..., Q, 1] x k_pos [..., 1, T] -> bool [..., Q, T] (causal, window)."""
    mask = k_pos <= q_pos
    if sliding_window is not None:
        mask &= k_pos > q_pos - sliding_window
    return mask


def _attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float
) -> torch.Tensor:
    """q [B, Hkv, M, D], k/v [B, T, Hkv, D], mask [B, 1, M, T] or None -> [B, Hkv, M, D]."""
    k = k.transpose(1, 2)  # [B, Hkv, T, D]
    v = v.transpose(1, 2)  # [B, Hkv, T, D]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


def torch_paged_decode_attention(
    query: torch.Tensor,
    layer: LayerKV,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    scale: float,
    sliding_window: int | None = None,
    num_splits: int | None = None,
) -> torch.Tensor:
    """query [batch, Hq, D] (last token of each context) -> [batch, Hq, D] in query.dtype.

    `num_splits` is a kernel tuning knob; the reference computes exactly and ignores it.
    """
    batch, num_q_heads, head_dim = query.shape
    hkv, bs = layer.num_kv_heads, layer.block_size
    lens = seq_lens.tolist()
    max_len = max(lens, default=0)
    if max_len == 0:
        return query.new_zeros(query.shape)
    first = 0  # first key position anybody sees
    if sliding_window is not None:
        first = max(0, min(n - sliding_window for n in lens if n > 0))
    b0, b1 = first // bs, -(-max_len // bs)
    k, v = gather_context(layer, block_tables[:, b0:b1], query.dtype)  # [batch, T, Hkv, D]
    k, v = k[:, first - b0 * bs : max_len - b0 * bs], v[:, first - b0 * bs : max_len - b0 * bs]
    mask = None
    if min(lens) != max_len or sliding_window is not None:
        k_pos = torch.arange(first, max_len).view(1, 1, 1, -1)  # [1, 1, 1, T]
        q_pos = (seq_lens.long() - 1).view(batch, 1, 1, 1).cpu()  # [batch, 1, 1, 1]
        mask = key_mask(q_pos, k_pos, sliding_window).to(query.device)  # [batch, 1, 1, T]
    q = query.view(batch, hkv, num_q_heads // hkv, head_dim)  # [batch, Hkv, G, D]
    out = _attend(q, k, v, mask, scale).reshape(batch, num_q_heads, head_dim)
    if min(lens) == 0:
        out = out.masked_fill((seq_lens == 0).view(batch, 1, 1), 0.0)
    return out


def _prefill_one(
    q: torch.Tensor,
    layer: LayerKV,
    block_row: torch.Tensor,
    seq_len: int,
    scale: float,
    sliding_window: int | None,
) -> torch.Tensor:
    """One sequence: q [q_len, Hq, D], the last q_len of seq_len tokens -> [q_len, Hq, D]."""
    q_len, num_q_heads, head_dim = q.shape
    hkv, bs = layer.num_kv_heads, layer.block_size
    group = num_q_heads // hkv
    first_q = seq_len - q_len  # position of the first query token
    first = 0 if sliding_window is None else max(0, first_q - sliding_window + 1)
    b0, b1 = first // bs, -(-seq_len // bs)
    k, v = gather_context(layer, block_row[b0:b1].view(1, -1), q.dtype)  # [1, T', Hkv, D]
    k, v = k[:, first - b0 * bs : seq_len - b0 * bs], v[:, first - b0 * bs : seq_len - b0 * bs]
    q_pos = torch.arange(first_q, seq_len).view(q_len, 1)  # [q_len, 1]
    k_pos = torch.arange(first, seq_len).view(1, -1)  # [1, T]
    mask = key_mask(q_pos, k_pos, sliding_window)  # [q_len, T]
    mask = mask.expand(group, q_len, -1).reshape(1, 1, group * q_len, -1).to(q.device)
    qg = q.view(q_len, hkv, group, head_dim).permute(1, 2, 0, 3)  # [Hkv, G, q_len, D]
    qg = qg.reshape(1, hkv, group * q_len, head_dim)  # [1, Hkv, G * q_len, D]
    out = _attend(qg, k, v, mask, scale)  # [1, Hkv, G * q_len, D]
    out = out.view(hkv, group, q_len, head_dim).permute(2, 0, 1, 3)  # [q_len, Hkv, G, D]
    return out.reshape(q_len, num_q_heads, head_dim)


def torch_paged_prefill_attention(
    query: torch.Tensor,
    layer: LayerKV,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    *,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """query [num_tokens, Hq, D] flat varlen -> [num_tokens, Hq, D]; one sdpa per sequence."""
    out = torch.zeros_like(query)  # [num_tokens, Hq, D]
    starts = query_start_loc.tolist()
    for b, seq_len in enumerate(seq_lens.tolist()):
        lo, hi = starts[b], starts[b + 1]
        if hi > lo:
            out[lo:hi] = _prefill_one(
                query[lo:hi], layer, block_tables[b], seq_len, scale, sliding_window
            )
    return out


def torch_paged_attention(
    query: torch.Tensor,
    layer: LayerKV,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    *,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Mixed batch: rows with q_len 1 go through one batched decode call, the rest per sequence."""
    starts = query_start_loc.tolist()
    q_lens = [hi - lo for lo, hi in itertools.pairwise(starts)]
    decode = [b for b, n in enumerate(q_lens) if n == 1]
    if len(decode) == len(q_lens):
        return torch_paged_decode_attention(
            query, layer, block_tables, seq_lens, scale=scale, sliding_window=sliding_window
        )
    out = torch.zeros_like(query)  # [num_tokens, Hq, D]
    if decode:
        rows = torch.tensor([starts[b] for b in decode], device=query.device)  # [n_decode]
        seqs = torch.tensor(decode, device=query.device)  # [n_decode]
        out[rows] = torch_paged_decode_attention(
            query[rows],
            layer,
            block_tables[seqs],
            seq_lens[seqs],
            scale=scale,
            sliding_window=sliding_window,
        )
    lens = seq_lens.tolist()
    for b, n in enumerate(q_lens):
        if n > 1:
            lo = starts[b]
            out[lo : lo + n] = _prefill_one(
                query[lo : lo + n], layer, block_tables[b], lens[b], scale, sliding_window
            )
    return out
