"""Transparent huge pages for the paged KV cache on the host.

Decode attention reads each sequence's blocks: for every layer a run of block_size x kv heads
x head dim K, then V (12 KiB in float32 at SmolLM2's 3 kv heads of 64), each block anywhere in
a cache of gigabytes. With 4 KiB pages nearly every run takes TLB misses and crosses page
boundaries, where the hardware prefetcher stops; with 2 MiB pages the whole cache is a few
thousand TLB entries. Linux backs anonymous memory with huge pages when THP is `always`, or
`madvise` (the default of many distributions) and the range was advised `MADV_HUGEPAGE`
before it is first touched; shared memory (memfd) follows `shmem_enabled` instead.

`host_zeros` allocates a zeroed host tensor in a fresh private anonymous mapping advised
`MADV_HUGEPAGE` before anything touches it (memory from the heap may have been touched
already, and glibc serves allocations up to 32 MiB from it once its threshold has risen), or
`MADV_NOHUGEPAGE` when asked for small pages (4 KiB pages even where THP is `always`); where
THP is unavailable, or for less than one huge page, it is a plain zeroed tensor. The side-by-side
measurement is `python -m kvmesh_kernels.cpu_bench --huge-pages` (docs/BENCHMARKS.md).
"""

from __future__ import annotations

import contextlib
import functools
import mmap
from pathlib import Path

import torch

THP = Path("/sys/kernel/mm/transparent_hugepage")


def _huge_page_bytes() -> int:
    """The size of a huge page (PMD) here: 2 MiB on x86-64, more on some arm64 kernels."""
    try:
        return int((THP / "hpage_pmd_size").read_text())
    except (OSError, ValueError):
        return 2 << 20


HUGE_PAGE_BYTES = _huge_page_bytes()


@functools.cache
def thp_mode() -> str:
    """The kernel's THP setting for anonymous memory (`always`, `madvise`, `never`), or
    `unavailable` off Linux or where the setting cannot be read."""
    try:
        text = (THP / "enabled").read_text()
    except OSError:
        return "unavailable"
    chosen = text[text.find("[") + 1 : text.find("]")] if "[" in text else ""
    return chosen or "unavailable"


def host_zeros(shape: tuple[int, ...], dtype: torch.dtype, huge_pages: bool = True) -> torch.Tensor:
    """A zeroed host tensor of `shape`. From one huge page of bytes on, where THP is available,
    in its own anonymous mapping advised for huge pages (`huge_pages`; they take effect where
    THP is `madvise` or `always`) or against them, which the zeroing then faults in. The
    tensor keeps the mapping alive."""
    nbytes = int(torch.Size(shape).numel()) * torch.empty(0, dtype=dtype).element_size()
    name = "MADV_HUGEPAGE" if huge_pages else "MADV_NOHUGEPAGE"
    advice: int | None = getattr(mmap, name, None)  # Linux only
    if thp_mode() == "unavailable" or advice is None or nbytes < HUGE_PAGE_BYTES:
        return torch.zeros(shape, dtype=dtype)
    region = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    with contextlib.suppress(OSError):  # refused: the kernel's default pages, same contents
        region.madvise(advice)
    tensor = torch.frombuffer(region, dtype=torch.uint8).view(dtype).view(shape)
    return tensor.zero_()  # faults every page in now, not during serving
