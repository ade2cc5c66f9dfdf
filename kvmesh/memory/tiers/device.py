"""Whole-block copies between the device cache and host rows, with the block gather/scatter ops.

The cache is block-major (one block, all layers, K and V, is one contiguous byte range), so a
set of blocks moves as one `gather_blocks` / `scatter_blocks`; host slots that are consecutive
are read and written as one view (no staging copy). On CUDA a reload runs on its own stream:
the compute stream waits on its event, the host never does.
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
    scatter_blocks,
    spec_to_dict,
)

from kvmesh.memory.tiers.host import HostTier


def _consecutive(slots: Sequence[int]) -> bool:
    return all(b == a + 1 for a, b in pairwise(slots))


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


class DeviceBlocks:
    """The device (or CPU engine) cache as whole-block byte rows."""

    def __init__(self, cache: PagedKVCache, model_id: str = "") -> None:
        self.cache = cache
        spec = cache.spec
        element = torch.empty((), dtype=spec.storage_dtype).element_size()
        self.data_bytes = prod(spec.data_shape[1:]) * element
        self.scale_bytes = prod(spec.scales_shape[1:]) * 4 if spec.quantized else 0
        self.block_bytes = self.data_bytes + self.scale_bytes
        self.layout = {**spec_to_dict(spec), "num_blocks": 0, "model": model_id}
        device = cache.data.device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    @property
    def pin(self) -> bool:
        return self.stream is not None

    def to_host(self, block_ids: Sequence[int], host: HostTier, slots: Sequence[int]) -> None:
        """Copy device blocks into host slots (done when this returns)."""
        raw = packed_to_bytes(gather_blocks(self.cache, list(block_ids)))
        count = len(block_ids)
        write_rows(host.data, slots, raw.data.view(count, -1).cpu())
        if host.scales is not None and raw.scales is not None:
            write_rows(host.scales, slots, raw.scales.view(count, -1).cpu())

    def from_host(
        self, host: HostTier, slots: Sequence[int], block_ids: Sequence[int]
    ) -> torch.cuda.Event | None:
        """Copy host slots into device blocks; on CUDA returns the copy's event (the compute
        stream already waits on it; the slots stay untouched until it completes)."""
        data = read_rows(host.data, slots).reshape(-1)
        scales = None if host.scales is None else read_rows(host.scales, slots).reshape(-1)
        if self.stream is None:
            self._scatter(block_ids, data, scales)
            return None
        device = self.cache.data.device
        self.stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(self.stream):
            data = data.to(device, non_blocking=True)
            scales = None if scales is None else scales.to(device, non_blocking=True)
            self._scatter(block_ids, data, scales)
            event = self.stream.record_event()
        torch.cuda.current_stream(device).wait_event(event)
        return event

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
