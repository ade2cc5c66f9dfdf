"""Whole-block copies between the device cache and host rows.

The cache is block-major (one block, all layers, K and V, is one contiguous byte range). On
CUDA a set of blocks moves as one `gather_blocks` / `scatter_blocks` (host slots that are
consecutive read as one view, no staging), a reload on its own stream: the compute stream
waits on its event, the host never does. On CPU each block is one row copy straight between
its cache range and its host slot (no staging buffer: the indexed ops run at a fraction of
memcpy speed there for block-sized rows).
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import pairwise
from math import prod

import torch
from kvmesh_kernels.cache import (
    PackedBytes,
    PagedKVCache,
    gather_blocks,
    packed_from_bytes,
    packed_to_bytes,
    raw_view,
    scatter_blocks,
    spec_to_dict,
)

from kvmesh.memory.tiers.host import HostTier


def _consecutive(slots: Sequence[int]) -> bool:
    return all(b == a + 1 for a, b in pairwise(slots))


def by_slot(slots: Sequence[int], block_ids: Sequence[int]) -> tuple[list[int], list[int]]:
    """The (slot, block) pairs ordered by slot, so consecutive slots read as one view."""
    pairs = sorted(zip(slots, block_ids, strict=True))
    return [p[0] for p in pairs], [p[1] for p in pairs]


def read_rows(buffer: torch.Tensor, slots: Sequence[int]) -> torch.Tensor:
    """Rows `slots` of `buffer` ([N, row bytes]): a view when they are consecutive."""
    if _consecutive(slots):
        return buffer[slots[0] : slots[0] + len(slots)]
    return buffer.index_select(0, torch.tensor(slots, dtype=torch.int64))


def write_rows(buffer: torch.Tensor, slots: Sequence[int], rows: torch.Tensor) -> None:
    if _consecutive(slots):
        buffer[slots[0] : slots[0] + len(slots)].copy_(rows)
    else:
        buffer.index_copy_(0, torch.tensor(slots, dtype=torch.int64), rows.cpu())


class DeviceCopy:
    """A host -> device copy issued on the copy stream (CUDA), between two timed events: its
    completion can be polled without blocking, and its own duration read once complete."""

    __slots__ = ("end", "start")

    def __init__(self, start: torch.cuda.Event, end: torch.cuda.Event) -> None:
        self.start, self.end = start, end

    def query(self) -> bool:
        """Whether the copy has completed (never blocks)."""
        return bool(self.end.query())

    def synchronize(self) -> None:
        """Wait until the copy has completed."""
        self.end.synchronize()

    def seconds(self) -> float:
        """The copy's own duration on the device (once complete): not the wait before it."""
        return self.start.elapsed_time(self.end) / 1000.0


class DeviceBlocks:
    """The device (or CPU engine) cache as whole-block byte rows."""

    def __init__(self, cache: PagedKVCache, model_id: str = "") -> None:
        spec = cache.spec
        element = torch.empty((), dtype=spec.storage_dtype).element_size()
        self.data_bytes = prod(spec.data_shape[1:]) * element
        self.scale_bytes = prod(spec.scales_shape[1:]) * 4 if spec.quantized else 0
        self.block_bytes = self.data_bytes + self.scale_bytes
        self.layout = {**spec_to_dict(spec), "num_blocks": 0, "model": model_id}
        device = cache.data.device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._bind(cache)

    def rebind(self, cache: PagedKVCache) -> None:
        """Follow the cache to new memory of the same spec (the engine moved it)."""
        if cache.spec != self.cache.spec or cache.data.device != self.cache.data.device:
            raise ValueError("rebind: the cache's spec and device must stay the same")
        self._bind(cache)

    def _bind(self, cache: PagedKVCache) -> None:
        self.cache = cache
        # CPU: each block's bytes as one row, copied directly to / from its host slot (one
        # memcpy per block, no staging: a block is one contiguous range of the cache)
        blocks = cache.spec.num_blocks
        self._rows = raw_view(cache.data).view(torch.uint8).reshape(blocks, -1)
        self._scale_rows = None
        if cache.scales is not None:
            self._scale_rows = cache.scales.view(torch.uint8).reshape(blocks, -1)

    @property
    def pin(self) -> bool:
        return self.stream is not None

    def to_host(self, block_ids: Sequence[int], host: HostTier, slots: Sequence[int]) -> None:
        """Copy device blocks into host slots (done when this returns)."""
        slots, block_ids = by_slot(slots, block_ids)
        if self.stream is None:
            self._copy_rows(block_ids, slots, to_host=True, host=host)
            return
        raw = packed_to_bytes(gather_blocks(self.cache, list(block_ids)))
        count = len(block_ids)
        write_rows(host.data, slots, raw.data.view(count, -1).cpu())
        if host.scales is not None and raw.scales is not None:
            write_rows(host.scales, slots, raw.scales.view(count, -1).cpu())

    def from_host(
        self, host: HostTier, slots: Sequence[int], block_ids: Sequence[int]
    ) -> DeviceCopy | None:
        """Copy host slots into device blocks; on CUDA returns the copy in flight (the compute
        stream already waits on it; the slots stay untouched until it completes), on CPU None
        (done when this returns)."""
        slots, block_ids = by_slot(slots, block_ids)
        if self.stream is None:
            self._copy_rows(block_ids, slots, to_host=False, host=host)
            return None
        data = read_rows(host.data, slots).reshape(-1)
        scales = None if host.scales is None else read_rows(host.scales, slots).reshape(-1)
        device = self.cache.data.device
        self.stream.wait_stream(torch.cuda.current_stream(device))
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(self.stream):
            start.record(self.stream)  # after the wait: times the copy alone
            data = data.to(device, non_blocking=True)
            scales = None if scales is None else scales.to(device, non_blocking=True)
            self._scatter(block_ids, data, scales)
            end.record(self.stream)
        torch.cuda.current_stream(device).wait_event(end)
        return DeviceCopy(start, end)

    def _copy_rows(
        self, block_ids: Sequence[int], slots: Sequence[int], *, to_host: bool, host: HostTier
    ) -> None:
        """CPU: one row copy per block between the cache and its host slot (numpy's copy:
        torch's per-call thread-pool wake-up costs more than a block's memcpy)."""
        pairs = [(self._rows.numpy(), host.data.numpy())]
        if self._scale_rows is not None and host.scales is not None:
            pairs.append((self._scale_rows.numpy(), host.scales.numpy()))
        for cache_rows, host_rows in pairs:
            for block, slot in zip(block_ids, slots, strict=True):
                if to_host:
                    host_rows[slot] = cache_rows[block]
                else:
                    cache_rows[block] = host_rows[slot]

    def _scatter(
        self, block_ids: Sequence[int], data: torch.Tensor, scales: torch.Tensor | None
    ) -> None:
        raw = PackedBytes(self.cache.spec, len(block_ids), data, scales)
        scatter_blocks(self.cache, list(block_ids), packed_from_bytes(raw))

    def payload(self, host: HostTier, slot: int) -> bytes:
        """One host slot as a disk payload (data bytes, then scale bytes)."""
        data = host.data[slot].numpy().tobytes()
        if host.scales is None:
            return data
        return data + host.scales[slot].numpy().tobytes()

    def load_payload(self, host: HostTier, slot: int, payload: memoryview) -> None:
        """Fill a host slot from a verified disk payload."""
        flat = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        host.data[slot].copy_(flat[: self.data_bytes])
        if host.scales is not None:
            host.scales[slot].copy_(flat[self.data_bytes :])
