"""Triton paged prefill / extend attention over a flat varlen batch.

Grid: (query tiles, num_kv_heads). Query tiles are numbered across the batch without padding:
sequence b owns `cdiv(q_len_b, BLOCK_Q)` consecutive tile ids; the launcher computes their
inclusive prefix sum on the device and each program finds its sequence by binary search, so
the launch needs no host synchronization (the grid is bounded by cdiv(num_tokens, BLOCK_Q) +
batch; programs past the last tile exit).

A tile holds BLOCK_Q query tokens x the G_PAD query heads of one kv head, flattened to
`M = BLOCK_Q * G_PAD` rows (row r = token r // G_PAD, head r % G_PAD), so each K/V tile read
through the block table serves all query heads of the group. The chunk of sequence b is the
last q_len of its seq_len tokens: query token i sits at position seq_len - q_len + i and sees
key positions t <= p (and t > p - window with a sliding window).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvmesh_kernels.triton_decode import LOG2E, dot_precision, kv_tile


@triton.jit
def _find_sequence(tile_cum_ptr, pid, batch, SEARCH_STEPS: tl.constexpr):
    """Smallest b with tile_cum[b] > pid (batch when none) and the first tile id of b."""
    lo = pid * 0
    hi = lo + batch
    for _ in range(SEARCH_STEPS):
        mid = (lo + hi) // 2
        go_left = tl.load(tile_cum_ptr + mid, mask=mid < batch, other=0) > pid
        active = lo < hi
        lo = tl.where(active & ~go_left, mid + 1, lo)
        hi = tl.where(active & go_left, mid, hi)
    first = tl.load(tile_cum_ptr + lo - 1, mask=lo > 0, other=0)
    return lo, first


@triton.jit
def _prefill_kernel(
    q_ptr,
    data_ptr,
    scale_ptr,
    bt_ptr,
    seq_lens_ptr,
    qsl_ptr,  # [batch + 1] int32
    tile_cum_ptr,  # [batch] int32, inclusive prefix sum of query tiles
    out_ptr,
    qk_scale,  # softmax scale * log2(e)
    window,  # 0 = none
    batch,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_bt,
    stride_blk,
    stride_kv,
    stride_tok,
    stride_head,
    sc_stride_blk,
    sc_stride_kv,
    sc_stride_tok,
    sc_stride_head,
    G: tl.constexpr,
    G_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    QUANT: tl.constexpr,
    PREC: tl.constexpr,
    UPCAST: tl.constexpr,
    SEARCH_STEPS: tl.constexpr,
):
    pid = tl.program_id(0)
    kvh = tl.program_id(1)
    b, first_tile = _find_sequence(tile_cum_ptr, pid, batch, SEARCH_STEPS)
    if b < batch:
        q_start = tl.load(qsl_ptr + b)
        q_len = tl.load(qsl_ptr + b + 1) - q_start
        seq_len = tl.load(seq_lens_ptr + b)
        ctx = seq_len - q_len  # position of the chunk's first token
        t0 = (pid - first_tile) * BLOCK_Q  # first query token of this tile within the chunk

        offs_m = tl.arange(0, BLOCK_Q * G_PAD)  # [M]
        offs_d = tl.arange(0, D_PAD)  # [D_PAD]
        d_mask = offs_d < HEAD_DIM
        tok_i = t0 + offs_m // G_PAD  # [M] query token index within the chunk
        g = offs_m % G_PAD
        r_mask = (tok_i < q_len) & (g < G)
        q_pos = ctx + tok_i  # [M]
        q_row = (q_start + tok_i).to(tl.int64) * stride_qt + (kvh * G + g) * stride_qh  # [M]
        q_mask = r_mask[:, None] & d_mask[None, :]
        q = tl.load(q_ptr + q_row[:, None] + offs_d[None, :], mask=q_mask, other=0.0)  # [M, D_PAD]
        if UPCAST:  # the interpreter's dot multiplies bf16 bit patterns
            q = q.to(tl.float32)
        bt_row = bt_ptr + b.to(tl.int64) * stride_bt

        hi = tl.minimum(ctx + t0 + BLOCK_Q, seq_len)  # last visible key + 1
        lo = tl.where(window > 0, tl.maximum(ctx + t0 - window + 1, 0), 0)
        m_i = tl.full([BLOCK_Q * G_PAD], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_Q * G_PAD], tl.float32)
        acc = tl.zeros([BLOCK_Q * G_PAD, D_PAD], tl.float32)
        for n0 in range(lo, hi, BLOCK_N):
            tok = n0 + tl.arange(0, BLOCK_N)  # [BLOCK_N]
            t_mask = tok < hi
            k, ks = kv_tile(
                data_ptr, scale_ptr, bt_row, tok, t_mask, kvh, 0, offs_d, d_mask,
                stride_blk, stride_kv, stride_tok, stride_head,
                sc_stride_blk, sc_stride_kv, sc_stride_tok, sc_stride_head, BLOCK_SIZE, QUANT,
            )  # fmt: skip
            v, vs = kv_tile(
                data_ptr, scale_ptr, bt_row, tok, t_mask, kvh, 1, offs_d, d_mask,
                stride_blk, stride_kv, stride_tok, stride_head,
                sc_stride_blk, sc_stride_kv, sc_stride_tok, sc_stride_head, BLOCK_SIZE, QUANT,
            )  # fmt: skip
            s = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=PREC)  # [M, BLOCK_N]
            s = s * (ks * qk_scale)[None, :]
            seen = (tok[None, :] <= q_pos[:, None]) & t_mask[None, :]
            if window > 0:
                seen = seen & (tok[None, :] > q_pos[:, None] - window)
            s = tl.where(seen, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))  # [M]
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that saw nothing yet
            alpha = tl.exp2(m_i - m_safe)
            p = tl.exp2(s - m_safe[:, None])  # [M, BLOCK_N]
            l_i = l_i * alpha + tl.sum(p, axis=1)
            pv = (p * vs[None, :]).to(q.dtype)
            acc = acc * alpha[:, None] + tl.dot(pv, v.to(q.dtype), input_precision=PREC)
            m_i = m_new

        o = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]  # [M, D_PAD]
        o_row = (q_start + tok_i).to(tl.int64) * stride_ot + (kvh * G + g) * stride_oh
        o_ptrs = out_ptr + o_row[:, None] + offs_d[None, :]
        tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=r_mask[:, None] & d_mask)


def launch_prefill(
    query: torch.Tensor,  # [num_tokens, Hq, D]
    data: torch.Tensor,  # [num_blocks, 2, block_size, Hkv, D]
    scales: torch.Tensor | None,  # [num_blocks, 2, block_size, Hkv] float32
    block_tables: torch.Tensor,  # [batch, max_blocks] int32
    seq_lens: torch.Tensor,  # [batch] int32
    query_start_loc: torch.Tensor,  # [batch + 1] int32
    out: torch.Tensor,  # [num_tokens, Hq, D]
    scale: float,
    window: int,
    interpreted: bool,
) -> None:
    """Run the prefill kernel into `out` (rows of every chunk are written)."""
    num_tokens, num_q_heads, head_dim = query.shape
    _, _, block_size, num_kv_heads, _ = data.shape
    batch = seq_lens.shape[0]
    if num_tokens == 0 or batch == 0:
        return
    group = num_q_heads // num_kv_heads
    g_pad = triton.next_power_of_2(group)
    rows = 16 if interpreted else 64
    block_q = max(1, rows // g_pad)
    q_lens = query_start_loc[1:] - query_start_loc[:-1]  # [batch]
    tile_cum = torch.cumsum(torch.div(q_lens + block_q - 1, block_q, rounding_mode="floor"), 0)
    tile_cum = tile_cum.to(torch.int32)  # [batch]
    grid = (triton.cdiv(num_tokens, block_q) + batch, num_kv_heads)
    sc = scales if scales is not None else data
    sc_strides = scales.stride() if scales is not None else (0, 0, 0, 0)
    _prefill_kernel[grid](
        query, data, sc, block_tables, seq_lens, query_start_loc, tile_cum, out,
        scale * LOG2E, window, batch,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        *data.stride()[:4], *sc_strides,
        G=group, G_PAD=g_pad, HEAD_DIM=head_dim, D_PAD=triton.next_power_of_2(head_dim),
        BLOCK_Q=block_q, BLOCK_N=16 if interpreted else 64, BLOCK_SIZE=block_size,
        QUANT=scales is not None, PREC=dot_precision(query.dtype, interpreted),
        UPCAST=interpreted,
        SEARCH_STEPS=max(1, batch.bit_length()),
    )  # fmt: skip
