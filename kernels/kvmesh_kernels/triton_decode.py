"""Triton paged decode attention: flash-decoding with split-K over the context.

Grid of the main kernel: (batch, num_kv_heads, num_splits). One program loads the query rows of
all `G = Hq // Hkv` query heads that share its kv head (padded to `G_PAD >= 16` rows so the
score product is a tensor-core dot), walks its slice of the context through the block table
`BLOCK_N` tokens at a time, and keeps an online softmax (running max `m`, sum `l`, accumulator
`acc`, all float32, exponentials in base 2). With one split it writes the normalized output
directly; otherwise it writes the partial `(m, l, acc)` and a reduce kernel combines the splits:

    M = max_s m_s,  w_s = 2^(m_s - M),  out = sum_s w_s acc_s / sum_s w_s l_s

Quantized caches are dequantized inside the loop: the int8/fp8 tile is cast to the query dtype
(exact: |q| <= 448 fits bf16/fp16 mantissas for the values it can take) and the per-token
scales multiply the scores (K) and the probabilities (V).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634
# Tokens per split below which splitting further costs more than it hides.
MIN_TOKENS_PER_SPLIT = 256
MAX_SPLITS = 64


@triton.jit
def kv_tile(
    data_ptr,
    scale_ptr,
    bt_row_ptr,
    tok,
    tok_mask,
    kv_head,
    which: tl.constexpr,
    offs_d,
    d_mask,
    stride_blk,
    stride_kv,
    stride_tok,
    stride_head,
    sc_stride_blk,
    sc_stride_kv,
    sc_stride_tok,
    sc_stride_head,
    BLOCK_SIZE: tl.constexpr,
    QUANT: tl.constexpr,
):
    """Raw K (which=0) or V (which=1) rows [N, D_PAD] of tokens `tok` [N] and scales [N]."""
    blk = tl.load(bt_row_ptr + tok // BLOCK_SIZE, mask=tok_mask, other=0).to(tl.int64)  # [N]
    off = (tok % BLOCK_SIZE).to(tl.int64)  # [N]
    base = blk * stride_blk + which * stride_kv + off * stride_tok + kv_head * stride_head  # [N]
    mask = tok_mask[:, None] & d_mask[None, :]
    x = tl.load(data_ptr + base[:, None] + offs_d[None, :], mask=mask, other=0.0)  # [N, D_PAD]
    if QUANT:
        sc_off = blk * sc_stride_blk + which * sc_stride_kv + off * sc_stride_tok
        s = tl.load(scale_ptr + sc_off + kv_head * sc_stride_head, mask=tok_mask, other=0.0)
    else:
        s = tl.full(tok.shape, 1.0, tl.float32)
    return x, s


@triton.jit
def _decode_kernel(
    q_ptr,
    data_ptr,
    scale_ptr,
    bt_ptr,
    seq_lens_ptr,
    out_ptr,
    part_acc_ptr,  # [batch, Hq, num_splits, D_PAD] float32
    part_ml_ptr,  # [batch, Hq, num_splits, 2] float32
    qk_scale,  # softmax scale * log2(e)
    window,  # sliding window in tokens; 0 = none
    num_splits,
    stride_qb,
    stride_qh,
    stride_ob,
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
    BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    QUANT: tl.constexpr,
    DIRECT: tl.constexpr,
    PREC: tl.constexpr,
    UPCAST: tl.constexpr,
):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    num_q_heads = tl.num_programs(1) * G
    seq_len = tl.load(seq_lens_ptr + b)
    start = tl.where(window > 0, tl.maximum(seq_len - window, 0), 0)
    per_split = tl.cdiv(tl.cdiv(seq_len - start, num_splits), BLOCK_N) * BLOCK_N
    lo = start + split * per_split
    hi = tl.minimum(lo + per_split, seq_len)

    offs_g = tl.arange(0, G_PAD)  # [G_PAD]
    offs_d = tl.arange(0, D_PAD)  # [D_PAD]
    g_mask = offs_g < G
    d_mask = offs_d < HEAD_DIM
    heads = kvh * G + offs_g  # [G_PAD]
    q_off = b.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptr + q_off, mask=g_mask[:, None] & d_mask[None, :], other=0.0)  # [G_PAD, D_PAD]
    if UPCAST:  # the interpreter's dot multiplies bf16 bit patterns
        q = q.to(tl.float32)
    bt_row = bt_ptr + b.to(tl.int64) * stride_bt

    m_i = tl.full([G_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, D_PAD], tl.float32)
    # Every tile of [lo, hi) holds at least one visible token, so m_i is finite after it.
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
        s = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=PREC)  # [G_PAD, BLOCK_N]
        s = s * (ks * qk_scale)[None, :]
        s = tl.where(t_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))  # [G_PAD]
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])  # [G_PAD, BLOCK_N]
        l_i = l_i * alpha + tl.sum(p, axis=1)
        pv = (p * vs[None, :]).to(q.dtype)
        acc = acc * alpha[:, None] + tl.dot(pv, v.to(q.dtype), input_precision=PREC)
        m_i = m_new

    if DIRECT:
        l_safe = tl.where(l_i > 0.0, l_i, 1.0)
        o = acc / l_safe[:, None]  # [G_PAD, D_PAD]
        o_off = b.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + offs_d[None, :]
        tl.store(out_ptr + o_off, o.to(out_ptr.dtype.element_ty), mask=g_mask[:, None] & d_mask)
    else:
        row = (b.to(tl.int64) * num_q_heads + heads) * num_splits + split  # [G_PAD]
        tl.store(part_acc_ptr + row[:, None] * D_PAD + offs_d[None, :], acc, mask=g_mask[:, None])
        tl.store(part_ml_ptr + row * 2, m_i, mask=g_mask)
        tl.store(part_ml_ptr + row * 2 + 1, l_i, mask=g_mask)


@triton.jit
def _reduce_kernel(
    part_acc_ptr,
    part_ml_ptr,
    out_ptr,
    num_splits,
    stride_ob,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    S_PAD: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    offs_s = tl.arange(0, S_PAD)  # [S_PAD]
    offs_d = tl.arange(0, D_PAD)  # [D_PAD]
    s_mask = offs_s < num_splits
    row = (b.to(tl.int64) * tl.num_programs(1) + h) * num_splits + offs_s  # [S_PAD]
    m = tl.load(part_ml_ptr + row * 2, mask=s_mask, other=float("-inf"))
    l = tl.load(part_ml_ptr + row * 2 + 1, mask=s_mask, other=0.0)  # noqa: E741
    m_max = tl.max(m, axis=0)
    m_max = tl.where(m_max > float("-inf"), m_max, 0.0)  # every split empty: weights 0 below
    w = tl.where(m > float("-inf"), tl.exp2(m - m_max), 0.0)  # [S_PAD]; empty splits weigh 0
    acc = tl.load(
        part_acc_ptr + row[:, None] * D_PAD + offs_d[None, :], mask=s_mask[:, None], other=0.0
    )
    total = tl.sum(w * l, axis=0)
    o = tl.sum(acc * w[:, None], axis=0) / tl.where(total > 0.0, total, 1.0)  # [D_PAD]
    o_off = b.to(tl.int64) * stride_ob + h * stride_oh + offs_d
    tl.store(out_ptr + o_off, o.to(out_ptr.dtype.element_ty), mask=offs_d < HEAD_DIM)


def dot_precision(dtype: torch.dtype, interpreted: bool) -> str:
    """Exact float32 products for float32 inputs (and in the interpreter, which upcasts)."""
    return "ieee" if dtype == torch.float32 or interpreted else "tf32"


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device; 1 elsewhere (the interpreter)."""
    if device.type != "cuda":
        return 1
    return int(torch.cuda.get_device_properties(device).multi_processor_count)


def choose_num_splits(batch: int, num_kv_heads: int, max_context: int, sms: int) -> int:
    """Enough (batch x kv head x split) programs for two waves of `sms`, each split keeping at
    least MIN_TOKENS_PER_SPLIT tokens of `max_context`; 1 when the batch alone fills the GPU."""
    programs = max(1, batch * num_kv_heads)
    wanted = triton.cdiv(2 * sms, programs)
    by_length = max(1, max_context // MIN_TOKENS_PER_SPLIT)
    return max(1, min(wanted, by_length, MAX_SPLITS))


def launch_decode(
    query: torch.Tensor,  # [batch, Hq, D]
    data: torch.Tensor,  # [num_blocks, 2, block_size, Hkv, D]
    scales: torch.Tensor | None,  # [num_blocks, 2, block_size, Hkv] float32
    block_tables: torch.Tensor,  # [batch, max_blocks] int32
    seq_lens: torch.Tensor,  # [batch] int32
    out: torch.Tensor,  # [batch, Hq, D]
    scale: float,
    window: int,
    num_splits: int,
    interpreted: bool,
) -> None:
    """Run the decode kernel (and the reduce kernel when num_splits > 1) into `out`."""
    batch, num_q_heads, head_dim = query.shape
    _, _, block_size, num_kv_heads, _ = data.shape
    group = num_q_heads // num_kv_heads
    d_pad = triton.next_power_of_2(head_dim)
    direct = num_splits == 1
    part_acc = part_ml = out  # placeholders, never touched when direct
    if not direct:
        part_acc = torch.empty(
            (batch, num_q_heads, num_splits, d_pad), dtype=torch.float32, device=query.device
        )
        part_ml = torch.empty(
            (batch, num_q_heads, num_splits, 2), dtype=torch.float32, device=query.device
        )
    sc = scales if scales is not None else data
    sc_strides = scales.stride() if scales is not None else (0, 0, 0, 0)
    _decode_kernel[(batch, num_kv_heads, num_splits)](
        query, data, sc, block_tables, seq_lens, out, part_acc, part_ml,
        scale * LOG2E, window, num_splits,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        *data.stride()[:4], *sc_strides,
        G=group, G_PAD=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim, D_PAD=d_pad,
        BLOCK_N=16 if interpreted else 64, BLOCK_SIZE=block_size, QUANT=scales is not None,
        DIRECT=direct, PREC=dot_precision(query.dtype, interpreted), UPCAST=interpreted,
    )  # fmt: skip
    if not direct:
        _reduce_kernel[(batch, num_q_heads)](
            part_acc, part_ml, out, num_splits, out.stride(0), out.stride(1),
            HEAD_DIM=head_dim, D_PAD=d_pad, S_PAD=triton.next_power_of_2(num_splits),
        )  # fmt: skip
