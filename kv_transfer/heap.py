"""Keep large, short-lived frame buffers in the heap (glibc), so reusing them costs no faults.

Every gRPC frame is a fresh ~2 MiB `bytes` on both sides (grpc's Python API takes and gives
`bytes`). glibc serves allocations above its mmap threshold with a fresh mapping and unmaps it
on free, so each frame's pages are faulted in again: measured on a 2-core machine, joining an
80-byte header and a 2 MiB payload ran at 0.36 GB/s that way and at 6.7 GB/s with the buffers
kept in the heap. `keep_frames_in_heap` raises the mmap and trim thresholds once per process.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 32 << 20  # glibc's maximum on 64-bit; frames stay well below it
TRIM_THRESHOLD_BYTES = 256 << 20  # free heap kept before it is returned to the system


@functools.cache
def keep_frames_in_heap() -> bool:
    """Raise glibc's thresholds (once); False where there is no glibc `mallopt`."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"))
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):
        return False
    ok = mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) == 1
    return mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES) == 1 and ok
