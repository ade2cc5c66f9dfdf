"""A contiguous arena of token slots: first-fit allocation over a coalescing free-extent list."""

from __future__ import annotations

import bisect


class ExtentArena:
    """Slots `[0, capacity)`; free space is a sorted list of disjoint, non-adjacent extents.

    `allocate` carves the request from the start of the lowest-offset extent that is large
    enough (first fit); `free` returns an extent and merges it with free neighbours, so two
    adjacent free extents never coexist.
    """

    def __init__(self, capacity: int) -> None:
        assert capacity > 0
        self.capacity = capacity
        self._offsets: list[int] = [0]
        self._lengths: list[int] = [capacity]

    @property
    def extents(self) -> tuple[tuple[int, int], ...]:
        """Free extents as (offset, length), by offset."""
        return tuple(zip(self._offsets, self._lengths, strict=True))

    def free_slots(self) -> int:
        return sum(self._lengths)

    def unusable_slots(self, size: int) -> int:
        """Free slots in extents too small to hold `size` contiguous slots."""
        return sum(length for length in self._lengths if length < size)

    def allocate(self, size: int) -> int | None:
        """Offset of `size` contiguous slots (first fit), or None when no extent is large enough."""
        assert size > 0
        for index, length in enumerate(self._lengths):
            if length >= size:
                offset = self._offsets[index]
                if length == size:
                    del self._offsets[index], self._lengths[index]
                else:
                    self._offsets[index] = offset + size
                    self._lengths[index] = length - size
                return offset
        return None

    def free(self, offset: int, size: int) -> None:
        """Return `[offset, offset + size)`, which must be allocated, merging with neighbours."""
        index = bisect.bisect_left(self._offsets, offset)
        end = offset + size
        assert offset >= 0 and end <= self.capacity
        assert index == len(self._offsets) or end <= self._offsets[index], "overlaps free extent"
        assert index == 0 or self._offsets[index - 1] + self._lengths[index - 1] <= offset
        if index < len(self._offsets) and self._offsets[index] == end:
            size += self._lengths[index]
            del self._offsets[index], self._lengths[index]
        if index > 0 and self._offsets[index - 1] + self._lengths[index - 1] == offset:
            self._lengths[index - 1] += size
            return
        self._offsets.insert(index, offset)
        self._lengths.insert(index, size)
