"""Transparent huge pages for the host KV cache: its own mapping, advised before the zeroing
first touches it (or against huge pages for the small-page baseline), and only where the
kernel's THP setting honours the advice."""

from __future__ import annotations

import pytest
import torch
from kvmesh_kernels.cache import KVCacheSpec, allocate_kv_cache
from kvmesh_kernels.hugepages import HUGE_PAGE_BYTES, host_zeros, thp_mode

ADVISED = thp_mode() in ("madvise", "always")
SPEC = KVCacheSpec(64, 4, 16, 4, 128, torch.float32)  # 32 MiB


def mappings(tensor: torch.Tensor) -> list[dict[str, str]]:
    """The smaps entries (field -> value) of the mappings that overlap `tensor`'s memory."""
    start = tensor.data_ptr()
    end = start + tensor.numel() * tensor.element_size()
    found: list[dict[str, str]] = []
    current: dict[str, str] | None = None
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head, _, rest = line.partition(" ")
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(part, 16) for part in head.split("-"))
                current = {} if lo < end and start < hi else None
                if current is not None:
                    found.append(current)
            elif current is not None:
                current[head.rstrip(":")] = rest.strip()
    return found


def huge_kib(tensor: torch.Tensor) -> int:
    return sum(int(m["AnonHugePages"].split()[0]) for m in mappings(tensor))


def flags(tensor: torch.Tensor) -> set[str]:
    return {flag for m in mappings(tensor) for flag in m.get("VmFlags", "").split()}


def thp_fallbacks() -> int:
    with open("/proc/vmstat") as vmstat:
        for line in vmstat:
            name, value = line.split()
            if name == "thp_fault_fallback":
                return int(value)
    return 0


@pytest.mark.skipif(not ADVISED, reason="transparent huge pages are off on this machine")
def test_the_cache_is_advised_and_backed_by_huge_pages_unless_the_kernel_fell_back() -> None:
    fallbacks = thp_fallbacks()
    cache = allocate_kv_cache(SPEC)
    assert not cache.data.any()
    assert "hg" in flags(cache.data)  # the advice, whatever memory the kernel then finds
    assert huge_kib(cache.data) >= HUGE_PAGE_BYTES // 1024 or thp_fallbacks() > fallbacks


@pytest.mark.skipif(thp_mode() == "unavailable", reason="no transparent huge pages here")
def test_the_small_page_baseline_is_advised_against_huge_pages() -> None:
    """`huge_pages=False` holds even where THP is `always` or the process advises everything."""
    cache = allocate_kv_cache(SPEC, huge_pages=False)
    assert not cache.data.any()
    assert "nh" in flags(cache.data) and huge_kib(cache.data) == 0


def test_memory_under_one_huge_page_is_a_plain_zeroed_tensor() -> None:
    small = host_zeros((3, 5), torch.bfloat16)
    assert small.shape == (3, 5) and small.dtype == torch.bfloat16 and not small.any()
    small[0, 0] = 1  # writable, like any other
    assert int(small.count_nonzero()) == 1


@pytest.mark.skipif(not ADVISED, reason="transparent huge pages are off on this machine")
def test_a_heap_chunk_already_touched_is_not_what_the_cache_gets() -> None:
    """With glibc's threshold raised (as a worker's gRPC receiver does), a freed, touched
    24 MiB chunk would be handed out again, too late to advise; the cache has its own."""
    from kv_transfer.heap import keep_frames_in_heap

    keep_frames_in_heap()
    scratch = torch.ones(24 << 20, dtype=torch.uint8)
    touched = scratch.data_ptr()
    del scratch
    cache = host_zeros((6 << 20,), torch.float32)  # 24 MiB
    assert cache.data_ptr() != touched and "hg" in flags(cache) and not cache.any()
    cache.fill_(1.0)
    assert float(cache.sum()) == cache.numel()
