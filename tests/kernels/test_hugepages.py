"""Transparent huge pages for the host KV cache: advised before first touch, zeroed, and only
where the kernel's THP setting honours the advice."""

from __future__ import annotations

import pytest
import torch
from kvmesh_kernels.cache import KVCacheSpec, allocate_kv_cache
from kvmesh_kernels.hugepages import HUGE_PAGE_BYTES, huge_zeros, thp_mode

ADVISED = thp_mode() in ("madvise", "always")


def anon_huge_kib(tensor: torch.Tensor) -> int:
    """AnonHugePages (KiB) of the mappings that overlap `tensor`'s memory, from smaps (the
    advice splits a mapping: the advised interior is a mapping of its own)."""
    start = tensor.data_ptr()
    end = start + tensor.numel() * tensor.element_size()
    total, inside = 0, False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(part, 16) for part in head.split("-"))
                inside = lo < end and start < hi
            elif inside and head == "AnonHugePages:":
                total += int(line.split()[1])
    return total


@pytest.mark.skipif(not ADVISED, reason="transparent huge pages are off on this machine")
def test_an_advised_cache_is_backed_by_huge_pages_and_zeroed() -> None:
    spec = KVCacheSpec(64, 4, 16, 4, 128, torch.float32)  # 32 MiB
    cache = allocate_kv_cache(spec)
    assert not cache.data.any()
    assert anon_huge_kib(cache.data) >= HUGE_PAGE_BYTES // 1024


@pytest.mark.skipif(thp_mode() != "madvise", reason="only `madvise` leaves unadvised memory small")
def test_a_cache_not_advised_stays_in_small_pages() -> None:
    spec = KVCacheSpec(64, 4, 16, 4, 128, torch.float32)
    cache = allocate_kv_cache(spec, huge_pages=False)
    assert not cache.data.any() and anon_huge_kib(cache.data) == 0


def test_memory_under_one_huge_page_is_a_plain_zeroed_tensor() -> None:
    small = huge_zeros((3, 5), torch.bfloat16)
    assert small.shape == (3, 5) and small.dtype == torch.bfloat16 and not small.any()
    small[0, 0] = 1  # writable, like any other
    assert int(small.count_nonzero()) == 1


@pytest.mark.skipif(not ADVISED, reason="transparent huge pages are off on this machine")
def test_memory_the_heap_already_touched_is_not_reused() -> None:
    """A freed and touched 24 MiB heap chunk (glibc's threshold risen) is not what the cache
    gets: it still comes in huge pages, and writing it leaves other memory alone."""
    scratch = torch.ones(24 << 20, dtype=torch.uint8)
    del scratch
    cache = huge_zeros((6 << 20,), torch.float32)  # 24 MiB
    assert not cache.any() and anon_huge_kib(cache) >= HUGE_PAGE_BYTES // 1024
    cache.fill_(1.0)
    assert float(cache.sum()) == cache.numel()
