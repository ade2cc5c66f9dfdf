"""Host-memory tier: a fixed array of block rows (pinned on CUDA) and its bookkeeping.

Each slot holds one whole block (all layers, K and V) as one contiguous row of bytes, plus a
row of quantization scales when the cache is quantized. A slot is in exactly one state:

    free       `_free`
    cached     `_index` (LRU, oldest first): a spilled prefix block, keyed by its hash
    in flight  `_inflight`: taken by a reload, freed once its copy to the device is done
    swapped    `_swapped[seq_id]`: the blocks of a preempted sequence, in table order
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass

import torch

from kvmesh.memory.tiers.blockfile import BlockMeta
from kvmesh.memory.tiers.watermarks import Watermarks


@dataclass(slots=True)
class HostEntry:
    meta: BlockMeta
    slot: int


class HostTier:
    """`capacity` block rows of `data_bytes` (+ `scale_bytes`) each."""

    name = "host"

    def __init__(
        self,
        capacity: int,
        data_bytes: int,
        scale_bytes: int = 0,
        *,
        pin: bool = False,
        watermarks: Watermarks | None = None,
    ) -> None:
        if capacity <= 0:
            raise ValueError(f"host tier capacity must be positive, got {capacity} blocks")
        self.capacity = capacity
        self.watermarks = watermarks or Watermarks()
        self.data = torch.empty((capacity, data_bytes), dtype=torch.uint8, pin_memory=pin)
        self.scales = None
        if scale_bytes:
            self.scales = torch.empty((capacity, scale_bytes), dtype=torch.uint8, pin_memory=pin)
        self._free: deque[int] = deque(range(capacity))
        self._index: OrderedDict[int, HostEntry] = OrderedDict()
        self._inflight: set[int] = set()
        self._swapped: dict[str, list[int]] = {}

    # -- counts ------------------------------------------------------------------------------
    @property
    def num_used(self) -> int:
        return self.capacity - len(self._free)

    @property
    def num_cached(self) -> int:
        return len(self._index)

    @property
    def num_free(self) -> int:
        return len(self._free)

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self._index

    def hashes(self) -> set[int]:
        return set(self._index)

    # -- slots -------------------------------------------------------------------------------
    def take_free(self, count: int) -> list[int] | None:
        """`count` free slots (now owned by the caller), or None when fewer are free."""
        if count > len(self._free):
            return None
        return [self._free.popleft() for _ in range(count)]

    def hold(self, slots: list[int]) -> None:
        """Slots the caller owns are now in flight (a copy to the device reads them)."""
        self._inflight.update(slots)

    def cached_slots(self) -> list[int]:
        return [entry.slot for entry in self._index.values()]

    def release(self, slots: list[int]) -> None:
        """Return slots the caller owns (in flight or freshly taken) to the free list."""
        for slot in slots:
            self._inflight.discard(slot)
            self._free.append(slot)

    # -- cached prefix blocks ----------------------------------------------------------------
    def add(self, meta: BlockMeta, slot: int) -> None:
        assert meta.block_hash not in self._index, "a hash has one host copy"
        self._index[meta.block_hash] = HostEntry(meta, slot)

    def restore(self, meta: BlockMeta, slot: int) -> None:
        """An in-flight slot whose copy to the device was cancelled before it ran: it holds
        exactly `meta`'s KV, and becomes that hash's cached copy again."""
        assert slot in self._inflight, "only an in-flight slot is restored"
        self._inflight.discard(slot)
        self.add(meta, slot)

    def get(self, block_hash: int) -> HostEntry | None:
        """The entry of `block_hash` (now most recently used), or None."""
        entry = self._index.get(block_hash)
        if entry is not None:
            self._index.move_to_end(block_hash)
        return entry

    def pop(self, block_hash: int, *, inflight: bool) -> HostEntry | None:
        """Remove the entry; its slot goes in flight (a reload reads it) or back to free."""
        entry = self._index.pop(block_hash, None)
        if entry is not None:
            if inflight:
                self._inflight.add(entry.slot)
            else:
                self._free.append(entry.slot)
        return entry

    def oldest(self) -> HostEntry | None:
        """The least recently used cached entry (the next to demote), or None."""
        return next(iter(self._index.values()), None)

    # -- swapped sequences -------------------------------------------------------------------
    def park(self, seq_id: str, slots: list[int]) -> None:
        assert seq_id not in self._swapped, f"{seq_id!r} is swapped out twice"
        self._swapped[seq_id] = slots

    def unpark(self, seq_id: str) -> list[int] | None:
        return self._swapped.pop(seq_id, None)

    def parked(self, seq_id: str) -> list[int] | None:
        return self._swapped.get(seq_id)

    def parked_ids(self) -> set[str]:
        return set(self._swapped)

    # -- integrity ---------------------------------------------------------------------------
    def check_integrity(self) -> None:
        """AssertionError unless every slot is in exactly one state."""
        cached = [e.slot for e in self._index.values()]
        swapped = [s for slots in self._swapped.values() for s in slots]
        every = list(self._free) + cached + list(self._inflight) + swapped
        assert len(every) == len(set(every)), "a host slot is in two states"
        assert sorted(every) == list(range(self.capacity)), "a host slot is lost"
        for block_hash, entry in self._index.items():
            assert entry.meta.block_hash == block_hash, "host entry indexed under a foreign hash"
