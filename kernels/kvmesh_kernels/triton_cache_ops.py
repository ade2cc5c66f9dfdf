"""Triton cache operations: KV write (quantizing on write) and copy-on-write block copy.

Quantization matches `kvmesh_kernels.quant`: one float32 scale per (token, kv head),
`scale = max(amax(|x|) / QMAX, MIN_SCALE)`, int8 rounds half to even and clamps to +-127, fp8
e4m3 saturates to +-448. The fp8 value is rounded to e4m3 in float32 arithmetic before the
cast, so the cast is exact on every backend (the interpreter's own float->fp8 conversion
drops the carry when rounding up crosses a power of two).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvmesh_kernels.cache import LayerKV, PagedKVCache
from kvmesh_kernels.quant import MIN_SCALE

_QUANT_CODE = {"auto": 0, "int8": 1, "fp8": 2}
# 1.5 * 2^23: adding then subtracting it rounds a float32 |x| < 2^22 to an integer, half to even.
_RINT_MAGIC = tl.constexpr(12582912.0)
_COPY_CHUNK = 1024


@triton.jit
def _rint(x):
    return (x + _RINT_MAGIC) - _RINT_MAGIC


@triton.jit
def _round_e4m3(y):
    """Round float32 y (|y| <= 448) to the nearest e4m3 value, half to even, still float32."""
    bits = y.to(tl.int32, bitcast=True)
    # Normal range: keep 3 mantissa bits; a carry out of the mantissa bumps the exponent.
    bits = (bits + 0x7FFFF + ((bits >> 20) & 1)) & -1048576  # -1048576 = ~0xFFFFF
    normal = bits.to(tl.float32, bitcast=True)
    subnormal = _rint(y * 512.0) * (1.0 / 512.0)  # e4m3 subnormals are multiples of 2^-9
    return tl.where(tl.abs(y) < 0.015625, subnormal, normal)


@triton.jit
def _store_row(
    src_ptr,
    stride_h,
    t,
    dst_ptr,
    sc_ptr,
    stride_head,
    sc_stride_head,
    H: tl.constexpr,
    H_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    QUANT: tl.constexpr,
    MIN_SC: tl.constexpr,
):
    """Copy src[t] [H, D] to dst [H, D] (strided), quantizing when QUANT is 1 or 2."""
    offs_h = tl.arange(0, H_PAD)  # [H_PAD]
    offs_d = tl.arange(0, D_PAD)  # [D_PAD]
    mask = (offs_h < H)[:, None] & (offs_d < HEAD_DIM)[None, :]
    x = tl.load(src_ptr + t + offs_h[:, None] * stride_h + offs_d[None, :], mask=mask, other=0.0)
    dst = dst_ptr + offs_h[:, None] * stride_head + offs_d[None, :]
    if QUANT == 0:
        tl.store(dst, x.to(dst_ptr.dtype.element_ty), mask=mask)
    else:
        xf = x.to(tl.float32)  # [H_PAD, D_PAD]
        qmax = 127.0 if QUANT == 1 else 448.0
        # IEEE division (tl.div_rn), so the result is bit-identical to the torch reference.
        amax = tl.max(tl.abs(xf), axis=1)  # [H_PAD]
        sc = tl.maximum(tl.div_rn(amax, tl.full(amax.shape, qmax, tl.float32)), MIN_SC)
        y = tl.div_rn(xf, tl.broadcast_to(sc[:, None], xf.shape))  # [H_PAD, D_PAD]
        y = tl.minimum(tl.maximum(y, -qmax), qmax)
        if QUANT == 1:  # noqa: SIM108 (constexpr branch, dtypes differ)
            q = _rint(y).to(tl.int8)
        else:
            q = _round_e4m3(y).to(tl.float8e4nv)
        tl.store(dst, q, mask=mask)
        tl.store(sc_ptr + offs_h * sc_stride_head, sc, mask=offs_h < H)


@triton.jit
def _write_kv_kernel(
    key_ptr,
    value_ptr,
    slot_ptr,
    data_ptr,
    scale_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_blk,
    stride_kv,
    stride_tok,
    stride_head,
    sc_stride_blk,
    sc_stride_kv,
    sc_stride_tok,
    sc_stride_head,
    H: tl.constexpr,
    H_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    QUANT: tl.constexpr,
    MIN_SC: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot >= 0:
        blk = slot // BLOCK_SIZE
        off = slot % BLOCK_SIZE
        dst = data_ptr + blk * stride_blk + off * stride_tok
        sc = scale_ptr + blk * sc_stride_blk + off * sc_stride_tok
        _store_row(
            key_ptr, stride_kh, t * stride_kt, dst, sc, stride_head, sc_stride_head,
            H, H_PAD, HEAD_DIM, D_PAD, QUANT, MIN_SC,
        )  # fmt: skip
        _store_row(
            value_ptr, stride_vh, t * stride_vt, dst + stride_kv, sc + sc_stride_kv,
            stride_head, sc_stride_head, H, H_PAD, HEAD_DIM, D_PAD, QUANT, MIN_SC,
        )  # fmt: skip


def triton_write_kv(
    layer: LayerKV, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Store key/value [num_tokens, Hkv, D] at slot_mapping [num_tokens] (-1 skips a token);
    quantizes (and stores scales) when the layer is int8 or fp8."""
    num_tokens, heads, head_dim = key.shape
    if num_tokens == 0:
        return
    if key.stride(-1) != 1 or value.stride(-1) != 1 or layer.data.stride(-1) != 1:
        raise ValueError("key, value and the cache need a contiguous head_dim axis")
    scales = layer.scales if layer.scales is not None else layer.data
    sc_strides = layer.scales.stride() if layer.scales is not None else (0, 0, 0, 0)
    _write_kv_kernel[(num_tokens,)](
        key, value, slot_mapping, layer.data, scales,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        *layer.data.stride()[:4], *sc_strides,
        H=heads, H_PAD=triton.next_power_of_2(heads), HEAD_DIM=head_dim,
        D_PAD=triton.next_power_of_2(head_dim), BLOCK_SIZE=layer.block_size,
        QUANT=_QUANT_CODE[layer.kv_dtype], MIN_SC=MIN_SCALE,
    )  # fmt: skip


@triton.jit
def _copy_blocks_kernel(flat_ptr, pairs_ptr, words_per_block, CHUNK: tl.constexpr):
    i = tl.program_id(0)
    offs = tl.program_id(1).to(tl.int64) * CHUNK + tl.arange(0, CHUNK)  # [CHUNK]
    src = tl.load(pairs_ptr + 2 * i).to(tl.int64)
    dst = tl.load(pairs_ptr + 2 * i + 1).to(tl.int64)
    mask = offs < words_per_block
    x = tl.load(flat_ptr + src * words_per_block + offs, mask=mask)
    tl.store(flat_ptr + dst * words_per_block + offs, x, mask=mask)


def _as_words(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor [num_blocks, ...] as [num_blocks, words] of the widest integer type
    that divides one block's bytes."""
    if not t.is_contiguous():
        raise ValueError("copy_blocks needs a contiguous cache tensor")
    flat = t.reshape(t.shape[0], -1).view(torch.uint8)  # [num_blocks, bytes]
    for word in (torch.int64, torch.int32, torch.int16):
        if flat.shape[1] % word.itemsize == 0:
            return flat.view(word)
    return flat


def triton_copy_blocks(cache: PagedKVCache, pairs: torch.Tensor) -> None:
    """For each row (src, dst) of pairs [N, 2], copy block src to dst (all layers, K and V,
    scales). Destinations must be distinct and not also sources."""
    pairs = pairs.to(device=cache.data.device, dtype=torch.int64).contiguous()  # [N, 2]
    if pairs.shape[0] == 0:
        return
    tensors = [cache.data] if cache.scales is None else [cache.data, cache.scales]
    for t in tensors:
        words = _as_words(t)  # [num_blocks, W]
        grid = (pairs.shape[0], triton.cdiv(words.shape[1], _COPY_CHUNK))
        _copy_blocks_kernel[grid](words, pairs, words.shape[1], CHUNK=_COPY_CHUNK)
