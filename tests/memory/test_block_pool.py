"""BlockPool: ref counts, free FIFO, segmented evictable queues."""

from __future__ import annotations

import pytest

from kvmesh.memory.block_pool import PROBATION, PROTECTED, BlockPool


def test_allocate_pops_in_order_and_none_when_short() -> None:
    pool = BlockPool(4, 16)
    assert pool.allocate(3) == [0, 1, 2]
    assert pool.allocate(2) is None
    assert pool.num_free == 1 and pool.num_in_use == 3
    pool.check_integrity([0, 1, 2])


def test_shared_block_frees_on_last_reference() -> None:
    pool = BlockPool(2, 16)
    (block,) = pool.allocate(1) or []
    pool.incref(block)
    pool.decref(block)
    assert pool.num_free == 1
    pool.decref(block)
    assert pool.num_free == 2
    with pytest.raises(AssertionError, match="ref count 0"):
        pool.decref(block)


def test_eviction_order_free_then_probation_then_protected() -> None:
    evicted: list[int] = []
    pool = BlockPool(4, 16, on_evict=evicted.append)
    blocks = pool.allocate(4) or []
    for block in blocks[:3]:
        pool.mark_cached(block)
    pool.protect(0)
    for block in blocks:
        pool.decref(block)
    assert (pool.segment(0), pool.segment(1)) == (PROTECTED, PROBATION)
    assert pool.allocate(1) == [3] and evicted == []
    assert pool.allocate(2) == [1, 2] and evicted == [1, 2]
    assert pool.allocate(1) == [0] and evicted == [1, 2, 0]
    assert pool.num_evictions == 3 and not pool.is_cached(0)
    pool.check_integrity([0, 1, 2, 3])


def test_protected_overflow_demotes_oldest_to_probation() -> None:
    pool = BlockPool(4, 16, protected_capacity=1)
    blocks = pool.allocate(2) or []
    for block in blocks:
        pool.mark_cached(block)
        pool.protect(block)
    pool.decref(0)
    pool.decref(1)
    assert (pool.segment(0), pool.segment(1)) == (PROBATION, PROTECTED)
    assert pool.num_evictable_protected == 1 and pool.num_evictable == 2
    pool.check_integrity([])


def test_incref_revives_an_evictable_block() -> None:
    pool = BlockPool(2, 16)
    pool.allocate(1)
    pool.mark_cached(0)
    pool.decref(0)
    pool.incref(0)
    assert pool.num_evictable == 0 and pool.ref_count(0) == 1
    pool.check_integrity([0])


def test_uncache_frees_an_evictable_block_and_leaves_a_held_one_in_use() -> None:
    pool = BlockPool(3, 16)
    held, idle = pool.allocate(2) or []
    for block in (held, idle):
        pool.mark_cached(block)
    pool.protect(idle)
    pool.decref(idle)
    pool.uncache(idle)
    pool.uncache(held)
    assert not pool.is_cached(idle) and not pool.is_cached(held)
    assert (pool.num_free, pool.num_evictable) == (2, 0)
    pool.check_integrity([held])
    pool.decref(held)
    assert (pool.num_free, pool.num_evictable) == (3, 0)
    pool.check_integrity([])
