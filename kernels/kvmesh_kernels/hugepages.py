"""Transparent huge pages for the paged KV cache on the host.

Decode attention reads each sequence's blocks: for every layer a run of block_size x kv heads
x head dim K, then V (12 KiB in float32 at SmolLM2's 3 kv heads of 64), each block anywhere in
a cache of gigabytes. With 4 KiB pages nearly every run takes TLB misses and crosses page
boundaries, where the hardware prefetcher stops; with 2 MiB pages the whole cache is a few
thousand TLB entries. Linux backs anonymous memory with huge pages when THP is `always`, or
`madvise` (the default of many distributions) and the range was advised `MADV_HUGEPAGE`
before it is first touched; shared memory (memfd) follows `shmem_enabled` instead.

`huge_zeros` allocates a zeroed host tensor whose 2 MiB-aligned interior is advised first;
where THP is off or the call is refused it is a plain zeroed tensor. The side-by-side
measurement is `python -m kvmesh_kernels.cpu_bench --huge-pages` (docs/BENCHMARKS.md).
"""

from __future__ import annotations

import ctypes
import functools
import sys
from pathlib import Path

import torch

HUGE_PAGE_BYTES = 2 << 20
MADV_HUGEPAGE = 14  # Linux <sys/mman.h>
THP_ENABLED = Path("/sys/kernel/mm/transparent_hugepage/enabled")


@functools.cache
def thp_mode() -> str:
    """The kernel's THP setting for anonymous memory (`always`, `madvise`, `never`), or
    `unavailable` off Linux or where the setting cannot be read."""
    try:
        text = THP_ENABLED.read_text()
    except OSError:
        return "unavailable"
    chosen = text[text.find("[") + 1 : text.find("]")] if "[" in text else ""
    return chosen or "unavailable"


@functools.cache
def _madvise() -> object | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    fn.restype = ctypes.c_int
    return fn


def advise_huge_pages(tensor: torch.Tensor) -> int:
    """Advise the 2 MiB-aligned interior of a host tensor's memory for huge pages; the bytes
    advised (0: not a host tensor, under 2 MiB, THP not in `madvise` or `always`, or refused).
    Only memory not yet touched is then faulted in as huge pages."""
    madvise = _madvise()
    if tensor.device.type != "cpu" or madvise is None or thp_mode() not in ("madvise", "always"):
        return 0
    start = tensor.data_ptr()
    end = start + tensor.numel() * tensor.element_size()
    lo = -(-start // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES
    hi = end // HUGE_PAGE_BYTES * HUGE_PAGE_BYTES
    if hi <= lo:
        return 0
    ok = madvise(ctypes.c_void_p(lo), hi - lo, MADV_HUGEPAGE) == 0  # type: ignore[operator]
    return hi - lo if ok else 0


def huge_zeros(shape: tuple[int, ...], dtype: torch.dtype, huge_pages: bool = True) -> torch.Tensor:
    """A zeroed host tensor; with `huge_pages` its memory is advised for huge pages before the
    zeroing first touches it."""
    tensor = torch.empty(shape, dtype=dtype)
    if huge_pages:
        advise_huge_pages(tensor)
    return tensor.zero_()
