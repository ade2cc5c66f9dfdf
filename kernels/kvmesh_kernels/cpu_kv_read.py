"""The read a decode step's attention cannot avoid, alone (`csrc/cpu_kv_read.cpp`).

`read_kv` reads every K and V row of each sequence's first `seq_lens[b]` tokens through its
block table, in table order, with the attention kernel's paced prefetch into L2, and nothing
else. Benchmarks time it beside the attention kernel on the same cache and tables: the
kernel's decode steps against what this machine reads from a paged cache (blocks scattered in
memory), where a streaming read of one buffer would overstate the rate.
"""

from __future__ import annotations

import ctypes
import functools
from typing import Any

import torch

from kvmesh_kernels.cache import LayerKV
from kvmesh_kernels.cpu_build import library

READ_ENTRY = "kvmesh_cpu_kv_read"
# Mirror of `ReadParams` in the C++ source, in order (every field 8 bytes).
_FIELDS = (
    *("data", "tables", "lens", "batch", "max_blocks", "num_blocks", "block_size"),
    *("elem_bytes", "token_bytes", "s_block", "s_kv", "num_threads"),
)


class _ReadParams(ctypes.Structure):
    _fields_ = [(name, ctypes.c_int64) for name in _FIELDS]


def available() -> bool:
    """Whether the C library (with this entry) loads on this machine."""
    lib = library()
    return lib is not None and hasattr(lib, READ_ENTRY)


def read_kv(
    layer: LayerKV,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    num_threads: int | None = None,
) -> int:
    """Read the K and V rows of seq_lens[b] tokens of every sequence b of one layer (block ids
    in block_tables [batch, max_blocks], clamped into the cache; at most max_blocks blocks a
    sequence, nothing for a negative length) on num_threads threads (default torch's); returns
    the xor of the 64-bit words read (a run's last bytes short of a 64-byte line one by one).
    Raises ValueError for a layer that is not a CPU cache contiguous within each block half,
    for tables and lengths that are not int32 of matching batch, or for num_threads below 1."""
    data = _checked_layer(layer)  # [num_blocks, 2, block_size, Hkv, D]
    tables = _int32(block_tables, "block_tables", 2)
    lens = _int32(seq_lens, "seq_lens", 1)
    if lens.shape[0] != tables.shape[0] or tables.shape[1] < 1:
        raise ValueError(
            f"read_kv: seq_lens {tuple(lens.shape)} must match block_tables "
            f"{tuple(tables.shape)} in batch, with at least one block column"
        )
    threads = torch.get_num_threads() if num_threads is None else num_threads
    if threads < 1:
        raise ValueError(f"read_kv: num_threads must be at least 1, got {threads}")
    params = _ReadParams(
        data=data.data_ptr(),
        tables=tables.data_ptr(),
        lens=lens.data_ptr(),
        batch=tables.shape[0],
        max_blocks=tables.shape[1],
        num_blocks=data.shape[0],
        block_size=layer.block_size,
        elem_bytes=data.element_size(),
        token_bytes=layer.num_kv_heads * layer.head_dim * data.element_size(),
        s_block=data.stride(0),
        s_kv=data.stride(1),
        num_threads=threads,
    )
    result = int(_entry()(ctypes.byref(params)))
    if result < 0:
        raise ValueError("read_kv: the library refused the arguments")
    return result


def _checked_layer(layer: LayerKV) -> torch.Tensor:
    """The layer's data [num_blocks, 2, block_size, Hkv, D], if the read can take it."""
    data = layer.data
    if data.device.type != "cpu":
        raise ValueError("read_kv: layer must be on the CPU")
    token_elems = layer.num_kv_heads * layer.head_dim
    if data.stride(-1) != 1 or data.stride(-2) != layer.head_dim or data.stride(-3) != token_elems:
        raise ValueError("read_kv: layer must be contiguous within each block half")
    return data


@functools.cache
def _entry() -> Any:
    """The C entry with its signature set (once)."""
    lib = library()
    if lib is None or not hasattr(lib, READ_ENTRY):
        raise RuntimeError("read_kv: the CPU kernel library is unavailable")
    entry = getattr(lib, READ_ENTRY)
    entry.argtypes = [ctypes.POINTER(_ReadParams)]
    entry.restype = ctypes.c_int64
    return entry


def _int32(x: torch.Tensor, name: str, ndim: int) -> torch.Tensor:
    """x as a contiguous CPU int32 tensor of ndim dims; ValueError naming `name` otherwise."""
    if x.dtype != torch.int32 or x.dim() != ndim or x.device.type != "cpu":
        raise ValueError(f"read_kv: {name} must be a CPU int32 tensor of {ndim} dims")
    return x.contiguous()
