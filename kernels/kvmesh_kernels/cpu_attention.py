"""Fused CPU paged attention: reads K/V blocks in place through the block table.

One kernel serves decode and prefill/extend (flat varlen queries); see
`csrc/cpu_paged_attention.cpp` for the algorithm. Queries are computed in float32 (converted
on entry), the cache is read in its storage dtype (float32, bfloat16, float16, int8 or fp8 with
per-(token, kv head) scales) and converted per row. Arguments are validated by `dispatch`.
"""

from __future__ import annotations

import ctypes

import torch

from kvmesh_kernels.cache import FP8_DTYPE, LayerKV
from kvmesh_kernels.cpu_build import ENTRY, library

_DTYPE_CODES = {
    torch.float32: 0,
    torch.bfloat16: 1,
    torch.float16: 2,
    torch.int8: 3,
    FP8_DTYPE: 4,
}
# Mirror of `Params` in the C++ source, in order (every field 8 bytes).
_FIELDS = (
    *("q", "out", "data", "scales", "fp8_lut", "block_tables", "seq_lens", "query_start_loc"),
    *("dtype", "num_blocks", "block_size", "num_kv_heads", "num_q_heads", "head_dim"),
    *("s_block", "s_kv", "s_tok", "s_head", "ss_block", "ss_kv", "ss_tok", "ss_head"),
    *("batch", "max_blocks", "window", "q_tile", "num_splits", "num_threads"),
)
# Query rows per work item: q_tile tokens x G heads stay within about 64 rows.
MAX_ROWS = 64


class _Params(ctypes.Structure):
    _fields_ = [*((name, ctypes.c_int64) for name in _FIELDS), ("scale", ctypes.c_double)]


_LUT: dict[str, torch.Tensor] = {}


def _fp8_lut() -> torch.Tensor:
    """float32 value of every e4m3 byte [256] (exact)."""
    if "fp8" not in _LUT:
        _LUT["fp8"] = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(FP8_DTYPE).float()
    return _LUT["fp8"]


def supports(query: torch.Tensor, layer: LayerKV) -> bool:
    """Whether the fused kernel can run these tensors (CPU, known dtypes, unit head stride)."""
    data = layer.data
    return (
        query.device.type == "cpu"
        and data.device.type == "cpu"
        and data.dtype in _DTYPE_CODES
        and data.stride(-1) == 1
        and (layer.scales is not None) == (data.dtype in (torch.int8, FP8_DTYPE))
        and layer.head_dim % 16 == 0
        and library() is not None
    )


def cpu_paged_attention(
    query: torch.Tensor,
    layer: LayerKV,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    *,
    scale: float,
    sliding_window: int | None = None,
    num_splits: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """query [num_tokens, Hq, D] flat varlen -> [num_tokens, Hq, D] in query.dtype.

    `out`, when given, is a contiguous float32 [num_tokens, Hq, D] buffer the kernel fills
    (every row is written, zeros where a row sees no key).
    """
    lib = library()
    assert lib is not None, "fused CPU kernel unavailable (check supports() first)"
    num_tokens, num_q_heads, head_dim = query.shape
    q = query.to(torch.float32).contiguous()  # [num_tokens, Hq, D]
    if out is None:
        out = torch.empty_like(q)
    assert out.dtype == torch.float32 and out.is_contiguous() and out.shape == q.shape
    tables = block_tables.to(torch.int32).contiguous()  # [batch, max_blocks]
    lens = seq_lens.to(torch.int32).contiguous()  # [batch]
    starts = query_start_loc.to(torch.int32).contiguous()  # [batch + 1]
    data = layer.data  # [num_blocks, 2, block_size, Hkv, D]
    scales = layer.scales  # [num_blocks, 2, block_size, Hkv] or None
    lut = _fp8_lut() if data.dtype == FP8_DTYPE else None
    group = num_q_heads // layer.num_kv_heads
    p = _Params(
        q=q.data_ptr(),
        out=out.data_ptr(),
        data=data.data_ptr(),
        scales=0 if scales is None else scales.data_ptr(),
        fp8_lut=0 if lut is None else lut.data_ptr(),
        block_tables=tables.data_ptr(),
        seq_lens=lens.data_ptr(),
        query_start_loc=starts.data_ptr(),
        dtype=_DTYPE_CODES[data.dtype],
        num_blocks=data.shape[0],
        block_size=layer.block_size,
        num_kv_heads=layer.num_kv_heads,
        num_q_heads=num_q_heads,
        head_dim=head_dim,
        s_block=data.stride(0),
        s_kv=data.stride(1),
        s_tok=data.stride(2),
        s_head=data.stride(3),
        ss_block=0 if scales is None else scales.stride(0),
        ss_kv=0 if scales is None else scales.stride(1),
        ss_tok=0 if scales is None else scales.stride(2),
        ss_head=0 if scales is None else scales.stride(3),
        batch=lens.shape[0],
        max_blocks=tables.shape[1],
        window=sliding_window or 0,
        q_tile=max(1, MAX_ROWS // group),
        num_splits=num_splits or 0,
        num_threads=torch.get_num_threads(),
        scale=float(scale),
    )
    if num_tokens and lens.shape[0]:
        rc = getattr(lib, ENTRY)(ctypes.byref(p))
        if rc != 0:
            raise RuntimeError(f"fused CPU attention kernel rejected its arguments (code {rc})")
    return out if query.dtype == torch.float32 else out.to(query.dtype)


def cpu_paged_decode_attention(
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
    """query [batch, Hq, D], one token per sequence -> [batch, Hq, D]; empty context -> zeros."""
    starts = torch.arange(query.shape[0] + 1, dtype=torch.int32)  # [batch + 1]
    return cpu_paged_attention(
        query,
        layer,
        block_tables,
        seq_lens,
        starts,
        scale=scale,
        sliding_window=sliding_window,
        num_splits=num_splits,
        out=out,
    )
