"""Fixed pool of KV blocks: ids, reference counts and the free / evictable queues.

Every block is in exactly one state:

    state                 ref  cached  lives in
    free                  0    no      `_free` (FIFO; initial order 0..n-1)
    in use                >=1  any     block tables (ref = number of table entries)
    evictable, probation  0    yes     `_probation` (LRU: head is evicted first)
    evictable, protected  0    yes     `_protected` (LRU; evicted only when probation is empty)

Allocation takes free blocks first, then evicts the least recently released probationary
block, then the least recently released protected one. Evicting a cached block calls
`on_evict(block_id)` so the prefix index can forget it. All operations are O(1).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable, Iterable

PROBATION = 0
PROTECTED = 1


class BlockPool:
    """Block ids `0..num_blocks-1` with reference counts and lazy eviction of cached blocks."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        protected_capacity: int | None = None,
        on_evict: Callable[[int], object] | None = None,
    ) -> None:
        if not isinstance(num_blocks, int) or num_blocks <= 0:
            raise ValueError(f"num_blocks must be a positive int, got {num_blocks!r}")
        if not isinstance(block_size, int) or block_size <= 0:
            raise ValueError(f"block_size must be a positive int, got {block_size!r}")
        if protected_capacity is None:
            protected_capacity = num_blocks // 2
        if protected_capacity < 0:
            raise ValueError(f"protected_capacity must be >= 0, got {protected_capacity}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.protected_capacity = protected_capacity
        self.on_evict = on_evict
        self.num_evictions = 0
        self._refs = [0] * num_blocks
        self._cached = [False] * num_blocks
        self._segment = [PROBATION] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._probation: OrderedDict[int, None] = OrderedDict()
        self._protected: OrderedDict[int, None] = OrderedDict()

    # -- counts ------------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Blocks allocatable now: free plus evictable cached blocks."""
        return len(self._free) + len(self._probation) + len(self._protected)

    @property
    def num_evictable(self) -> int:
        return len(self._probation) + len(self._protected)

    @property
    def num_evictable_protected(self) -> int:
        return len(self._protected)

    @property
    def num_in_use(self) -> int:
        return self.num_blocks - self.num_free

    def ref_count(self, block_id: int) -> int:
        return self._refs[block_id]

    def is_cached(self, block_id: int) -> bool:
        return self._cached[block_id]

    def segment(self, block_id: int) -> int:
        return self._segment[block_id]

    # -- allocation --------------------------------------------------------------------------
    def allocate(self, count: int) -> list[int] | None:
        """`count` blocks with ref count 1, or None (nothing changed) if fewer are allocatable."""
        if count > self.num_free:
            return None
        return [self._take_one() for _ in range(count)]

    def _take_one(self) -> int:
        if self._free:
            block = self._free.popleft()
        else:
            queue = self._probation if self._probation else self._protected
            block, _ = queue.popitem(last=False)
            self._evict(block)
        self._refs[block] = 1
        return block

    def _evict(self, block: int) -> None:
        self._cached[block] = False
        self._segment[block] = PROBATION
        self.num_evictions += 1
        if self.on_evict is not None:
            self.on_evict(block)

    def incref(self, block: int) -> None:
        """Take one more reference; a cached block at ref 0 leaves its evictable queue."""
        if self._refs[block] == 0:
            assert self._cached[block], f"incref of free uncached block {block}"
            queue = self._protected if self._segment[block] == PROTECTED else self._probation
            del queue[block]
        self._refs[block] += 1

    def decref(self, block: int) -> None:
        """Drop one reference; at zero a cached block becomes evictable (MRU end), else free."""
        refs = self._refs[block] - 1
        assert refs >= 0, f"decref of block {block} with ref count 0"
        self._refs[block] = refs
        if refs:
            return
        if not self._cached[block]:
            self._free.append(block)
        elif self._segment[block] == PROTECTED:
            self._protected[block] = None
            if len(self._protected) > self.protected_capacity:
                self._demote_oldest_protected()
        else:
            self._probation[block] = None

    def _demote_oldest_protected(self) -> None:
        block, _ = self._protected.popitem(last=False)
        self._segment[block] = PROBATION
        self._probation[block] = None

    # -- cache state -------------------------------------------------------------------------
    def mark_cached(self, block: int) -> None:
        """An in-use block now carries a prefix hash; it enters the probationary segment."""
        assert self._refs[block] > 0, f"mark_cached of unreferenced block {block}"
        self._cached[block] = True
        self._segment[block] = PROBATION

    def uncache(self, block: int) -> None:
        """A cached block loses its prefix hash without being evicted: unreferenced, it moves
        from its evictable queue to the free list; in use, it is freed like any block later."""
        assert self._cached[block], f"uncache of uncached block {block}"
        if self._refs[block] == 0:
            queue = self._protected if self._segment[block] == PROTECTED else self._probation
            del queue[block]
            self._free.append(block)
        self._cached[block] = False
        self._segment[block] = PROBATION

    def protect(self, block: int) -> None:
        """Promote an in-use cached block to the protected segment (applies on release)."""
        assert self._refs[block] > 0 and self._cached[block], f"protect of block {block}"
        self._segment[block] = PROTECTED

    # -- integrity ---------------------------------------------------------------------------
    def check_integrity(self, table_refs: Iterable[int]) -> None:
        """AssertionError unless queues, cache flags and ref counts agree with `table_refs`."""
        expected = [0] * self.num_blocks
        for block in table_refs:
            expected[block] += 1
        for block in range(self.num_blocks):
            assert self._refs[block] == expected[block], (
                f"block {block}: ref count {self._refs[block]} != {expected[block]} table refs"
            )
        free, prob, prot = set(self._free), set(self._probation), set(self._protected)
        assert len(free) == len(self._free), "duplicate block in free queue"
        assert not (free & prob or free & prot or prob & prot), "block in two queues"
        in_use = {b for b in range(self.num_blocks) if self._refs[b] > 0}
        assert not in_use & (free | prob | prot), "referenced block sits in a free queue"
        total = len(free) + len(prob) + len(prot) + len(in_use)
        assert total == self.num_blocks, (
            f"free {len(free)} + evictable {len(prob) + len(prot)} + in use {len(in_use)}"
            f" != total {self.num_blocks}"
        )
        assert not any(self._cached[b] for b in free), "cached block in free queue"
        assert all(self._cached[b] and self._segment[b] == PROBATION for b in prob), (
            "probation queue holds an uncached or protected block"
        )
        assert all(self._cached[b] and self._segment[b] == PROTECTED for b in prot), (
            "protected queue holds an uncached or probationary block"
        )
        assert len(prot) <= self.protected_capacity, "protected segment over capacity"
