"""Recorded kernel calls replayed by one ctypes call (`csrc/cpu_program.cpp`).

A `Program` holds calls of this library's kernels with every argument fixed (addresses of
static buffers, packed weights and cache layers; sizes; thread count) except the step's two
counts, which `run(rows, seqs)` passes in: the token rows to every op, the sequences to the
parameter fields recorded per sequence (attention's batch). The calls are exactly what the
Python wrappers (`cpu_fused`, `cpu_gemm`, `cpu_attention.FusedCall`, `cpu_cache_ops.WriteCall`)
would make for the same tensors, so a replay computes bit for bit what the eager calls
compute. The tensors behind the recorded addresses must outlive the program: `keep` holds them.

Nothing is checked at replay beyond what the kernels check themselves; the builder (the
native executor's `step_program`) checks shapes, dtypes and strides once, when it records.
"""

from __future__ import annotations

import ctypes
import struct
from typing import Any

import torch

from kvmesh_kernels.cpu_build import ENTRY, WRITE_ENTRY, library

SLOTS = 16  # int64 slots per op: the kind, then the kernel's arguments without the rows
COUNTS = ("rows", "seqs")  # what a parameter field is set to at each replay
_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}
RMS_NORM, ADD_RMS_NORM, ROPE, GEMM, GEMM_SILU_MUL, PARAMS, HEAD_RMS_NORM = 1, 2, 3, 4, 5, 6, 7


def supported() -> bool:
    """Whether the built library has the program runner."""
    lib = library()
    return lib is not None and hasattr(lib, "kvmesh_cpu_run_program")


def _bits(value: float) -> int:
    """A double's bit pattern as an int64 (how an op's double argument travels)."""
    return int(struct.unpack("<q", struct.pack("<d", value))[0])


def _address(function: Any) -> int:
    """The address of a ctypes function of the library."""
    address = ctypes.cast(function, ctypes.c_void_p).value
    assert address is not None
    return int(address)


def _ptr(t: torch.Tensor | None) -> int:
    return 0 if t is None else int(t.data_ptr())


class Program:
    """Kernel calls recorded once, replayed with a row count (see the module doc)."""

    def __init__(self, dtype: torch.dtype, threads: int) -> None:
        lib = library()
        assert lib is not None and supported(), "CPU kernel library without the program runner"
        self._run = lib.kvmesh_cpu_run_program
        self._run.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64]
        self._run.restype = ctypes.c_int64
        self._entries = {name: _address(getattr(lib, name)) for name in (ENTRY, WRITE_ENTRY)}
        self.dtype_code = _DTYPE_CODES[dtype]
        self.threads = threads
        self._ops: list[list[int]] = []
        self.keep: list[Any] = []  # what the recorded addresses point into
        self._table: torch.Tensor | None = None

    def _add(self, kind: int, *args: int) -> None:
        assert len(args) < SLOTS, "an op has at most 15 arguments"
        self._ops.append([kind, *args, *([0] * (SLOTS - 1 - len(args)))])
        self._table = None

    def rms_norm(self, x: torch.Tensor, w: torch.Tensor, y: torch.Tensor, eps: float) -> None:
        """y[:rows] = norm(x[:rows]) (`cpu_fused.rms_norm`); x row-strided, y contiguous."""
        self._add(
            RMS_NORM, self.dtype_code, _ptr(x), x.stride(0), _ptr(w), _ptr(y), x.shape[1],
            _bits(eps), self.threads,
        )  # fmt: skip

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, w: torch.Tensor, y: torch.Tensor, eps: float
    ) -> None:
        """residual += x, y = norm(residual) over the first rows (`cpu_fused.add_rms_norm`)."""
        self._add(
            ADD_RMS_NORM, self.dtype_code, _ptr(x), x.stride(0), _ptr(residual), _ptr(w), _ptr(y),
            residual.shape[1], _bits(eps), self.threads,
        )  # fmt: skip

    def head_rms_norm(self, x: torch.Tensor, w: torch.Tensor, eps: float) -> None:
        """Norm every head of x[:rows] [rows, H, D] in place (`cpu_fused.head_rms_norm_`)."""
        _, heads, dim = x.shape
        self._add(
            HEAD_RMS_NORM, self.dtype_code, _ptr(x), heads, x.stride(0), x.stride(1), _ptr(w),
            dim, _bits(eps), self.threads,
        )  # fmt: skip

    def rope(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor
    ) -> None:
        """Rotate x [rows, H, D] in place at positions[:rows] (`cpu_fused.rope_`)."""
        _, heads, dim = x.shape
        self._add(
            ROPE, self.dtype_code, _ptr(x), heads, x.stride(0), x.stride(1), dim, _ptr(cos),
            _ptr(sin), _ptr(positions), cos.shape[0], self.threads,
        )  # fmt: skip

    def gemm(
        self,
        x: torch.Tensor,
        packed: Any,
        bias: torch.Tensor | None,
        y: torch.Tensor,
        prefetch: bool = True,
    ) -> None:
        """y[:rows] = x[:rows] . W^T + bias (`cpu_gemm.linear`); packed a `PackedWeight`."""
        self._add(
            GEMM, self.dtype_code, _ptr(x), x.stride(0), _ptr(packed.data), _ptr(bias), _ptr(y),
            y.stride(0), packed.out_features, packed.in_features, self.threads, int(prefetch),
        )  # fmt: skip

    def gemm_silu_mul(self, x: torch.Tensor, packed: Any, y: torch.Tensor) -> None:
        """y[:rows] = silu(x . Wg^T) * (x . Wu^T) (`cpu_gemm.gate_up_silu`)."""
        self._add(
            GEMM_SILU_MUL, self.dtype_code, _ptr(x), x.stride(0), _ptr(packed.data), _ptr(y),
            y.stride(0), packed.out_features, packed.in_features, self.threads,
        )  # fmt: skip

    def params_call(
        self, entry: str, params: ctypes.Structure, field: str, count: str = "rows"
    ) -> None:
        """entry(&params) with params.<field> set to the step's `count` (COUNTS: the token
        rows, e.g. the KV write's `num_tokens`, or the sequences, attention's `batch`); every
        other field as recorded. The structure is kept alive here."""
        offset = getattr(type(params), field).offset
        assert offset % 8 == 0, "the counted field is an int64 slot of the structure"
        self.keep.append(params)
        which = COUNTS.index(count)
        self._add(PARAMS, self._entries[entry], ctypes.addressof(params), offset // 8, which)

    def __len__(self) -> int:
        return len(self._ops)

    def run(self, rows: int, seqs: int) -> None:
        """Replay every op over `rows` token rows of `seqs` sequences; RuntimeError naming
        the op that failed."""
        table = self._table
        if table is None:
            table = self._table = torch.tensor(self._ops, dtype=torch.int64)  # [ops, SLOTS]
        rc = int(self._run(table.data_ptr(), len(self._ops), rows, seqs))
        if rc != 0:
            op, code = divmod(rc, 1000)
            kind = self._ops[op - 1][0] if 0 < op <= len(self._ops) else None
            raise RuntimeError(f"CPU program op {op - 1} (kind {kind}) failed with code {code}")
