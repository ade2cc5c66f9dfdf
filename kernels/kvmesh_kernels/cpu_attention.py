"""Fused CPU paged attention: reads K/V blocks in place through the block table.

One kernel serves decode and prefill/extend (flat varlen queries); see
`csrc/cpu_paged_attention.cpp` for the algorithm. Queries are read in their own dtype and
layout (float32, bfloat16, float16; unit last stride) and computed in float32; the output is
written in the query's dtype; the cache is read in its storage dtype (float32, bfloat16,
float16, int8 or fp8 with per-(token, kv head) scales). Arguments are validated by `dispatch`
or `AttentionPlan`.
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
# Appended after `scale` (a library built from an older source reads only the prefix).
_TAIL = ("q_dtype", "s_qtok", "s_qhead", "out_dtype", "s_otok", "s_ohead", "isa")
# Query/output element types the kernel reads and writes directly (codes as the cache's).
IO_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Params.isa: 0 picks the best path the CPU runs; the others cap it (benchmarks, tests).
ISAS = {"auto": 0, "baseline": 1, "avx2": 2, "avx512": 3, "avx512bf16": 4}
# Query rows per work item: q_tile tokens x G heads stay within about 64 rows.
MAX_ROWS = 64
# The kernel's nonzero return codes (documented at its entry point).
_ERRORS = {
    1: "bad shape parameters",
    2: "unknown cache dtype",
    3: "a sequence's seq_len lies outside [0, max_blocks * block_size] or its q_len < 0",
}


class _Params(ctypes.Structure):
    _fields_ = [
        *((name, ctypes.c_int64) for name in _FIELDS),
        ("scale", ctypes.c_double),
        *((name, ctypes.c_int64) for name in _TAIL),
    ]


_LUT: dict[str, torch.Tensor] = {}


def _fp8_lut() -> torch.Tensor:
    """float32 value of every e4m3 byte [256] (exact)."""
    if "fp8" not in _LUT:
        _LUT["fp8"] = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(FP8_DTYPE).float()
    return _LUT["fp8"]


def supports_layer(layer: LayerKV) -> bool:
    """Whether the fused kernel can read this cache layer (CPU, known dtype, unit head stride,
    head_dim a multiple of 16, library built)."""
    data = layer.data
    return (
        data.device.type == "cpu"
        and data.dtype in _DTYPE_CODES
        and data.stride(-1) == 1
        and (layer.scales is not None) == (data.dtype in (torch.int8, FP8_DTYPE))
        and layer.head_dim % 16 == 0
        and library() is not None
    )


def supports(query: torch.Tensor, layer: LayerKV) -> bool:
    """Whether the fused kernel can run these tensors (CPU query and a supported layer)."""
    return query.device.type == "cpu" and supports_layer(layer)


class FusedCall:
    """One step's metadata prepared for the kernel: a ctypes `Params` whose metadata fields are
    filled once, so a per-layer call sets only the query, output and cache pointers.

    `layer` fixes the cache format (dtype, shape, strides: the same for every layer view of
    one cache). block_tables [batch, max_blocks], seq_lens [batch], query_start_loc
    [batch + 1] are converted to int32 once and kept alive here. Arguments must have been
    validated (dispatch or AttentionPlan).
    """

    def __init__(
        self,
        layer: LayerKV,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        query_start_loc: torch.Tensor,
        *,
        num_splits: int | None = None,
    ) -> None:
        lib = library()
        assert lib is not None, "fused CPU kernel unavailable (check supports() first)"
        self._entry = getattr(lib, ENTRY)
        self.tables = block_tables.to(torch.int32).contiguous()  # [batch, max_blocks]
        self.lens = seq_lens.to(torch.int32).contiguous()  # [batch]
        self.starts = query_start_loc.to(torch.int32).contiguous()  # [batch + 1]
        self.batch = int(self.lens.shape[0])
        data = layer.data  # [num_blocks, 2, block_size, Hkv, D]
        scales = layer.scales  # [num_blocks, 2, block_size, Hkv] or None
        sstr = (0, 0, 0, 0) if scales is None else scales.stride()
        lut = _fp8_lut() if data.dtype == FP8_DTYPE else None
        self.num_kv_heads = layer.num_kv_heads
        self.params = _Params(
            fp8_lut=0 if lut is None else lut.data_ptr(),
            block_tables=self.tables.data_ptr(),
            seq_lens=self.lens.data_ptr(),
            query_start_loc=self.starts.data_ptr(),
            dtype=_DTYPE_CODES[data.dtype],
            num_blocks=data.shape[0],
            block_size=layer.block_size,
            num_kv_heads=layer.num_kv_heads,
            head_dim=layer.head_dim,
            s_block=data.stride(0),
            s_kv=data.stride(1),
            s_tok=data.stride(2),
            s_head=data.stride(3),
            ss_block=sstr[0],
            ss_kv=sstr[1],
            ss_tok=sstr[2],
            ss_head=sstr[3],
            batch=self.batch,
            max_blocks=self.tables.shape[1],
            num_splits=num_splits or 0,
        )

    def __call__(
        self,
        query: torch.Tensor,
        data_ptr: int,
        scales_ptr: int,
        *,
        scale: float,
        sliding_window: int | None,
        batch: int | None = None,
        out: torch.Tensor | None = None,
        isa: str = "auto",
    ) -> torch.Tensor:
        """query [num_tokens, Hq, D] of the first `batch` sequences (default all) against the
        cache layer at data_ptr (scales at scales_ptr, 0 when not quantized) -> [num_tokens,
        Hq, D] in query.dtype.

        float32 / bfloat16 / float16 queries are read in place (any token and head strides,
        unit last stride); the result is written in that dtype, into `out` when given (a
        float32 / bfloat16 / float16 [num_tokens, Hq, D] tensor with unit last stride; every
        row is written, zeros where a row sees no key; returned converted to query.dtype when
        the dtypes differ). `isa` caps the kernel's instruction set (ISAS keys).
        """
        num_tokens = query.shape[0]
        out = self.prepare(
            query, data_ptr, scales_ptr, scale=scale, sliding_window=sliding_window,
            batch=batch, out=out, isa=isa,
        )  # fmt: skip
        p = self.params
        if num_tokens and p.batch:
            rc = self._entry(ctypes.byref(p))
            if rc != 0:
                reason = _ERRORS.get(rc, "unknown")
                raise RuntimeError(
                    f"fused CPU attention kernel rejected its arguments (code {rc}: {reason})"
                )
        return out if out.dtype == query.dtype else out.to(query.dtype)

    def prepare(
        self,
        query: torch.Tensor,
        data_ptr: int,
        scales_ptr: int,
        *,
        scale: float,
        sliding_window: int | None,
        batch: int | None = None,
        out: torch.Tensor | None = None,
        isa: str = "auto",
    ) -> torch.Tensor:
        """Fill `params` for a call on these arguments (as `__call__` documents them) without
        running it; returns the output tensor the call writes (`out` when given). What a
        recorded program (`cpu_program`) replays."""
        num_q_heads = query.shape[1]
        q = _io_tensor(query)  # [num_tokens, Hq, D]
        if out is None:
            out = torch.empty(query.shape, dtype=q.dtype)
        assert out.dtype in IO_DTYPES and out.stride(-1) == 1 and out.shape == query.shape
        self._query = q  # a converted query must live until the call
        p = self.params
        p.q, p.out, p.data, p.scales = q.data_ptr(), out.data_ptr(), data_ptr, scales_ptr
        p.q_dtype, p.s_qtok, p.s_qhead = _DTYPE_CODES[q.dtype], q.stride(0), q.stride(1)
        p.out_dtype, p.s_otok, p.s_ohead = _DTYPE_CODES[out.dtype], out.stride(0), out.stride(1)
        p.num_q_heads = num_q_heads
        p.q_tile = max(1, MAX_ROWS // (num_q_heads // self.num_kv_heads))
        p.batch = self.batch if batch is None else batch
        p.window = sliding_window or 0
        p.num_threads = torch.get_num_threads()
        p.scale = float(scale)
        p.isa = ISAS[isa]
        return out


def _io_tensor(x: torch.Tensor) -> torch.Tensor:
    """x as the kernel reads it: a float32/bfloat16/float16 tensor with unit last stride."""
    if x.dtype not in IO_DTYPES:
        x = x.to(torch.float32)
    return x if x.stride(-1) == 1 else x.contiguous()


def layer_pointers(layer: LayerKV) -> tuple[int, int]:
    """(data, scales) addresses of a layer view; scales 0 when not quantized."""
    return layer.data.data_ptr(), 0 if layer.scales is None else layer.scales.data_ptr()


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
    isa: str = "auto",
) -> torch.Tensor:
    """query [num_tokens, Hq, D] flat varlen -> [num_tokens, Hq, D] in query.dtype.

    `out`, when given, is a float32/bfloat16/float16 [num_tokens, Hq, D] buffer with unit last
    stride that the kernel fills (every row is written, zeros where a row sees no key). `isa`
    caps the instruction set (ISAS keys; tests and benchmarks).
    """
    call = FusedCall(layer, block_tables, seq_lens, query_start_loc, num_splits=num_splits)
    data_ptr, scales_ptr = layer_pointers(layer)
    return call(
        query, data_ptr, scales_ptr, scale=scale, sliding_window=sliding_window, out=out, isa=isa
    )


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
    isa: str = "auto",
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
        isa=isa,
    )
