"""The native executor's fused elementwise ops on CPU (`csrc/cpu_fused_ops.cpp`) and the
sampler's kernels (`csrc/cpu_sampling.cpp`: argmax_rows, race_rows, top_cut, logprob_rows).

float32 and bfloat16 tensors on the CPU with unit inner stride, library built
(`fused_supported`); the functions assert that and otherwise raise RuntimeError on a kernel
refusal. Each computes what transformers' Llama-family modules compute in that dtype, with the
same roundings (see the C source); only float32 sums, the rsqrt and SiLU's exp may differ in
the last bits (exp: within 2 ulp of torch's, so a bfloat16 SiLU rounds differently only where the
float32 value lies within that of a rounding boundary).

    add_rms_norm(x, residual, w, eps) -> y       residual <- x + residual (in place), y = norm
    rms_norm(x, w, eps) -> y                     x [rows, n] (row-strided), y contiguous
    head_rms_norm_(x, w, eps)                    x [T, H, D] (token/head strided) in place,
                                                 rms_norm of each head (Qwen3's q/k norms)
    silu_mul(gate_up) -> y                       [rows, 2n] (row-strided) -> [rows, n]
    rope_(x, cos, sin, positions)                x [T, H, D] (token/head strided) in place
    argmax_rows(x) -> ids                        x [rows, n] (row-strided) -> int64 [rows],
                                                 torch's `x.max(dim=-1).indices` exactly
    race_rows(x, inv_temp, keys[, floors]) -> ids  one draw per row from softmax(x * inv_temp),
                                                 keyed by int64 keys [rows] (Gumbel-max race),
                                                 among values x * inv_temp >= floors [rows]
    top_cut(x, inv_temp, top_k, top_p, min_p)    per row the smallest tempered value the
                                                 sampler's filters keep (race_rows' floors)
    logprob_rows(x, tokens, k) -> Logprobs       per row log_softmax(x) at tokens [rows], the
                                                 token's rank and the top-k (ids, logprobs)
"""

from __future__ import annotations

import ctypes
from typing import NamedTuple

import torch

from kvmesh_kernels.cpu_build import library

_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}
_P, _I, _D = ctypes.c_void_p, ctypes.c_int64, ctypes.c_double


def fused_supported(*tensors: torch.Tensor) -> bool:
    """CPU tensors of one supported dtype with unit last stride, and the library built."""
    first = tensors[0]
    return (
        first.dtype in _DTYPE_CODES
        and all(
            t.device.type == "cpu" and t.dtype == first.dtype and t.stride(-1) == 1 for t in tensors
        )
        and library() is not None
    )


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """x [rows, n] (rows strided), residual [rows, n] contiguous (updated to x + residual),
    weight [n] -> norm(x + residual) [rows, n]."""
    rows, n = residual.shape
    assert residual.is_contiguous() and x.shape == residual.shape and weight.shape == (n,)
    assert fused_supported(x, residual, weight)
    out = torch.empty_like(residual)  # [rows, n]
    _call(
        "kvmesh_cpu_add_rms_norm",
        ctypes.c_int(_DTYPE_CODES[x.dtype]),
        _P(x.data_ptr()),
        _I(x.stride(0) if rows > 1 else n),  # a lone row's stride is arbitrary
        _P(residual.data_ptr()),
        _P(weight.data_ptr()),
        _P(out.data_ptr()),
        _I(rows),
        _I(n),
        _D(eps),
        _I(torch.get_num_threads()),
    )
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [rows, n] (rows strided) -> norm(x) [rows, n] contiguous."""
    rows, n = x.shape
    assert weight.shape == (n,) and weight.is_contiguous() and fused_supported(x, weight)
    out = torch.empty((rows, n), dtype=x.dtype)  # [rows, n]
    _call(
        "kvmesh_cpu_rms_norm",
        ctypes.c_int(_DTYPE_CODES[x.dtype]),
        _P(x.data_ptr()),
        _I(x.stride(0) if rows > 1 else n),  # a lone row's stride is arbitrary
        _P(weight.data_ptr()),
        _P(out.data_ptr()),
        _I(rows),
        _I(n),
        _D(eps),
        _I(torch.get_num_threads()),
    )
    return out


def head_rms_norm_(x: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    """Normalize every head of x [T, H, D] in place (token and head strides, unit last stride;
    Qwen3's q/k norms on the q|k|v output) with weight [D]: `rms_norm` of each head."""
    tokens, heads, dim = x.shape
    assert weight.shape == (dim,) and weight.is_contiguous() and fused_supported(x, weight)
    _call(
        "kvmesh_cpu_head_rms_norm",
        ctypes.c_int(_DTYPE_CODES[x.dtype]),
        _P(x.data_ptr()),
        _I(tokens),
        _I(heads),
        _I(x.stride(0) if tokens > 1 else heads * x.stride(1)),  # a lone token's is arbitrary
        _I(x.stride(1) if heads > 1 else dim),
        _P(weight.data_ptr()),
        _I(dim),
        _D(eps),
        _I(torch.get_num_threads()),
    )


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [rows, 2n] (rows strided, gate | up) -> silu(gate) * up [rows, n] contiguous."""
    rows, width = gate_up.shape
    assert width % 2 == 0 and fused_supported(gate_up)
    n = width // 2
    out = torch.empty((rows, n), dtype=gate_up.dtype)  # [rows, n]
    if rows == 0 or n == 0:
        return out
    _call(
        "kvmesh_cpu_silu_mul",
        ctypes.c_int(_DTYPE_CODES[gate_up.dtype]),
        _P(gate_up.data_ptr()),
        _I(gate_up.stride(0) if rows > 1 else width),  # a lone row's stride is arbitrary
        _P(out.data_ptr()),
        _I(rows),
        _I(n),
        _I(torch.get_num_threads()),
    )
    return out


def rope_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor) -> None:
    """Rotate x [T, H, D] in place with cos/sin [P, D] rows at positions [T] int64."""
    tokens, heads, dim = x.shape
    assert cos.shape == sin.shape and cos.shape[1] == dim and cos.is_contiguous()
    assert sin.is_contiguous() and fused_supported(x, cos, sin)  # one dtype, unit last stride
    assert positions.dtype == torch.int64 and positions.is_contiguous()
    assert positions.shape == (tokens,) and positions.device.type == "cpu"
    _call(
        "kvmesh_cpu_rope",
        ctypes.c_int(_DTYPE_CODES[x.dtype]),
        _P(x.data_ptr()),
        _I(tokens),
        _I(heads),
        _I(x.stride(0)),
        _I(x.stride(1)),
        _I(dim),
        _P(cos.data_ptr()),
        _P(sin.data_ptr()),
        _P(positions.data_ptr()),
        _I(cos.shape[0]),
        _I(torch.get_num_threads()),
    )


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """x [rows, n] (rows strided, n > 0) -> int64 [rows]: the index of each row's largest
    value, the first on ties, a row's first NaN where it holds one."""
    return _per_row("kvmesh_cpu_argmax_rows", x, torch.int64)


def race_rows(
    x: torch.Tensor,
    inv_temp: torch.Tensor,
    keys: torch.Tensor,
    floors: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [rows, n] logits (rows strided, n > 0), inv_temp float32 [rows], keys int64 [rows] ->
    int64 [rows]: row r's token drawn from softmax(x[r] * inv_temp[r]) by the Gumbel-max race
    with uniforms from a counter-based generator keyed by keys[r] (the same key gives the same
    token, whatever the batch). -inf logits are never drawn, nor (with `floors`, float32
    [rows]) values x[r] * inv_temp[r] below floors[r]."""
    floor_column = None if floors is None else _column(floors, torch.float32, x)
    temps, key_column = _column(inv_temp, torch.float32, x), _column(keys, torch.int64, x)
    return _per_row("kvmesh_cpu_race_rows", x, torch.int64, temps, key_column, floor_column)


def top_cut(
    x: torch.Tensor,
    inv_temp: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
) -> torch.Tensor:
    """x [rows, n] logits (rows strided, n > 0); per row inv_temp, top_p, min_p float32 and
    top_k int64 [rows] (0: off; top_p 1 and min_p 0: off) -> float32 [rows]: the smallest
    tempered value x * inv_temp that min_p, then top_k, then top_p keep (ties at each cut
    kept; -inf where nothing is cut): `race_rows`' floors."""
    columns = [_column(inv_temp, torch.float32, x), _column(top_k, torch.int64, x)]
    columns += [_column(top_p, torch.float32, x), _column(min_p, torch.float32, x)]
    return _per_row("kvmesh_cpu_top_cut", x, torch.float32, *columns)


class Logprobs(NamedTuple):
    """Raw-model log-probabilities of one position per row."""

    token_logprob: torch.Tensor  # float32 [rows]: log_softmax(x)[token]
    token_rank: torch.Tensor  # int64 [rows]: 1 + the number of logits above the token's
    top_ids: torch.Tensor  # int64 [rows, k]: the k largest logits, descending
    top_logprobs: torch.Tensor  # float32 [rows, k]: their log-probabilities


MAX_TOP_LOGPROBS = 64  # the kernel's selection slots


def logprob_rows(x: torch.Tensor, tokens: torch.Tensor, k: int) -> Logprobs:
    """x [rows, n] raw logits (rows strided, n > 0), tokens int64 [rows] in [0, n), 0 <= k <=
    min(MAX_TOP_LOGPROBS, n) -> float32 log_softmax(x) at each row's token, its rank and the k
    most likely tokens (the smaller id first on ties), without a float32 copy of the rows. A
    row whose log_softmax is undefined (NaN or +inf logits, or all -inf) gets NaN
    log-probabilities, as log_softmax gives, and top ids 0 .. k-1."""
    rows, n = x.shape
    assert fused_supported(x) and n > 0 and 0 <= k <= min(MAX_TOP_LOGPROBS, n)
    out = Logprobs(
        token_logprob=torch.empty(rows, dtype=torch.float32),  # [rows]
        token_rank=torch.empty(rows, dtype=torch.int64),  # [rows]
        top_ids=torch.empty(rows, k, dtype=torch.int64),  # [rows, k]
        top_logprobs=torch.empty(rows, k, dtype=torch.float32),  # [rows, k]
    )
    if rows == 0:
        return out
    token_column = _column(tokens, torch.int64, x)  # held until the call returns
    _row_call("kvmesh_cpu_logprob_rows", x, _P(token_column.data_ptr()), _I(k), *out)
    return out


def _column(values: torch.Tensor, dtype: torch.dtype, x: torch.Tensor) -> torch.Tensor:
    """One value per row of x, contiguous in `dtype`."""
    assert values.shape == (x.shape[0],)
    return values.to(dtype).contiguous()


def _per_row(
    name: str, x: torch.Tensor, out_dtype: torch.dtype, *columns: torch.Tensor | None
) -> torch.Tensor:
    """Call a row kernel `name(dtype, x, row_stride, rows, n, *columns, out, threads)` over x
    [rows, n] (n > 0); returns out [rows] of `out_dtype`."""
    rows, n = x.shape
    assert fused_supported(x) and n > 0
    out = torch.empty(rows, dtype=out_dtype)  # [rows]
    if rows:
        _row_call(name, x, *columns, out)
    return out


def _row_call(name: str, x: torch.Tensor, *args: object) -> None:
    """`name(dtype, x, row_stride, rows, n, *args, threads)` over x [rows, n]; a tensor in
    `args` is passed as its data pointer, None as a null pointer."""
    rows, n = x.shape
    pointers = [_pointer(a) for a in args]
    _call(
        name,
        ctypes.c_int(_DTYPE_CODES[x.dtype]),
        _P(x.data_ptr()),
        _I(x.stride(0) if rows > 1 else n),  # a lone row's stride is arbitrary
        _I(rows),
        _I(n),
        *pointers,
        _I(torch.get_num_threads()),
    )


def _pointer(arg: object) -> object:
    """A tensor's data pointer, None as a null pointer, anything else (a ctypes value) as is."""
    if isinstance(arg, torch.Tensor):
        return _P(arg.data_ptr())
    return _P(None) if arg is None else arg


def _call(name: str, *args: object) -> None:
    lib = library()
    assert lib is not None, "fused CPU library unavailable (check fused_supported first)"
    rc = getattr(lib, name)(*args)
    if rc != 0:
        raise RuntimeError(f"{name} rejected its arguments (code {rc})")
