"""`BlockStore`: whole-block gather/scatter between a block-major cache and raw byte buffers.

Payload of n blocks (the wire format; independent of any kernel library):
`[n * scales_bytes_per_block][n * kv_bytes_per_block]` — scales first (float32, so both parts
stay aligned), each part in block order.
"""

from __future__ import annotations

import numpy as np
import torch

from kv_transfer.errors import FrameError
from kv_transfer.layout import KVLayout
from kv_transfer.registered import SharedRegion, consecutive


class BlockStore:
    """A cache `[num_blocks, L, 2, bs, H, D]` plus optional scales `[num_blocks, L, 2, bs, H]`.

    With `region`, both tensors lie in that shared mapping: a receiver can then register the
    cache and grant senders write windows into it (`region_offsets`)."""

    def __init__(
        self,
        cache: torch.Tensor,
        scales: torch.Tensor | None = None,
        *,
        model_id: str = "",
        region: SharedRegion | None = None,
    ) -> None:
        if not cache.is_contiguous() or (scales is not None and not scales.is_contiguous()):
            raise FrameError("cache", "cache and scales must be contiguous")
        self.cache = cache
        self.scales = scales
        self.region = region
        # A CUDA cache is registered as its own storage (CUDA IPC); scales would need a second.
        self.device_window = region is None and cache.device.type == "cuda" and scales is None
        self._kv_base = self._scales_base = 0
        if region is not None:
            self._kv_base = region.offset_of(cache)
            self._scales_base = region.offset_of(scales) if scales is not None else 0
        elif self.device_window:
            self._kv_base = int(cache.storage_offset()) * cache.element_size()
        self.layout = KVLayout.of(cache, scales, model_id=model_id)
        self.num_blocks = int(cache.shape[0])
        # Host caches as uint8 rows [num_blocks, bytes] for numpy's row scatter, which copies
        # whole rows: 1.8x faster than torch's index_copy_ here (bench/micro_choices.py).
        self._kv_rows = _host_rows(cache)
        self._scale_rows = _host_rows(scales) if scales is not None else None

    def check_ids(self, ids: torch.Tensor, field: str) -> None:
        """Raise `FrameError(field)` unless every id is a valid block id."""
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.num_blocks):
            raise FrameError(field, f"block id outside [0, {self.num_blocks})")

    def region_offsets(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Byte offsets in the registered memory (`region`, or a CUDA cache's own storage) of
        blocks `ids`' KV rows (and scales rows), int64 [n]."""
        assert self.grantable
        kv = self._kv_base + ids * self.layout.kv_bytes_per_block
        if self.scales is None:
            return kv, None
        return kv, self._scales_base + ids * self.layout.scales_bytes_per_block

    @property
    def grantable(self) -> bool:
        """Whether senders can be granted windows into this cache (registered memory)."""
        return self.region is not None or self.device_window

    def row_views(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The cache (and scales) as uint8 rows `[num_blocks, bytes per block]`."""
        kv = self.cache.view(self.num_blocks, -1).view(torch.uint8)
        if self.scales is None:
            return kv, None
        return kv, self.scales.view(self.num_blocks, -1).view(torch.uint8)

    def _views(self, buf: torch.Tensor, n: int) -> tuple[torch.Tensor | None, torch.Tensor]:
        """Split a uint8 buffer of n blocks into (scales view, kv view) shaped like the cache."""
        sb = n * self.layout.scales_bytes_per_block
        kb = n * self.layout.kv_bytes_per_block
        if buf.numel() < sb + kb:
            raise FrameError("payload_len", f"need {sb + kb} bytes for {n} blocks")
        kv = buf[sb : sb + kb].view(self.cache.dtype).view(n, *self.cache.shape[1:])
        if self.scales is None:
            return None, kv
        return buf[:sb].view(torch.float32).view(n, *self.scales.shape[1:]), kv

    def gather_into(self, ids: torch.Tensor, buf: torch.Tensor) -> int:
        """Copy blocks `ids` (int64 [n]) into the front of uint8 `buf`; return bytes written."""
        n = int(ids.numel())
        ids = ids.to(self.cache.device, non_blocking=True)
        scales_view, kv_view = self._views(buf, n)
        torch.index_select(self.cache, 0, ids, out=kv_view)
        if scales_view is not None:
            assert self.scales is not None
            torch.index_select(self.scales, 0, ids, out=scales_view)
        return n * self.layout.bytes_per_block

    def run_view(self, ids: torch.Tensor) -> torch.Tensor | None:
        """Blocks `ids` (int64 [n]) as one uint8 view [n * bytes_per_block] of the cache, their
        payload in place, when they are consecutive ids of a host cache without scales; else
        None (the payload must be gathered)."""
        if self._kv_rows is None or self.scales is not None or ids.numel() == 0:
            return None
        if not consecutive(ids):
            return None
        first, n = int(ids[0]), int(ids.numel())
        return self.row_views()[0][first : first + n].reshape(-1)

    def scatter_from(self, ids: torch.Tensor, buf: torch.Tensor) -> None:
        """Write n blocks from the front of uint8 `buf` into cache rows `ids` (int64 [n])."""
        n = int(ids.numel())
        if self._kv_rows is not None and buf.device.type == "cpu":
            sb, kb = n * self.layout.scales_bytes_per_block, n * self.layout.kv_bytes_per_block
            if buf.numel() < sb + kb:
                raise FrameError("payload_len", f"need {sb + kb} bytes for {n} blocks")
            raw, rows = buf.numpy(), ids.cpu().numpy()
            self._kv_rows[rows] = raw[sb : sb + kb].reshape(n, -1)
            if self._scale_rows is not None:
                self._scale_rows[rows] = raw[:sb].reshape(n, -1)
            return
        self._views(buf, n)  # FrameError when `buf` is short
        sb, kb = n * self.layout.scales_bytes_per_block, n * self.layout.kv_bytes_per_block
        ids = ids.to(self.cache.device, non_blocking=True)
        kv_rows, scale_rows = self.row_views()  # bytes: index_copy_ has no fp8 kernel
        kv_rows.index_copy_(0, ids, buf[sb : sb + kb].view(n, -1))
        if scale_rows is not None:
            scale_rows.index_copy_(0, ids, buf[:sb].view(n, -1))


def _host_rows(tensor: torch.Tensor) -> np.ndarray | None:
    """A CPU tensor's bytes as a writable uint8 array [num_blocks, bytes per block]."""
    if tensor.device.type != "cpu" or tensor.numel() == 0:
        return None
    return tensor.detach().view(int(tensor.shape[0]), -1).view(torch.uint8).numpy()


def as_ids(block_ids: object, field: str) -> torch.Tensor:
    """Block ids (sequence or tensor) as a contiguous int64 CPU tensor [n]."""
    ids = torch.as_tensor(block_ids, dtype=torch.int64).reshape(-1).contiguous()
    if ids.numel() == 0:
        raise FrameError(field, "empty block set")
    return ids


def frames_for(num_blocks: int, bytes_per_block: int, frame_bytes: int) -> list[tuple[int, int]]:
    """Split a block set into frames of whole blocks: [(block_offset, n)] of ≤ frame_bytes each
    (a block larger than frame_bytes travels alone)."""
    per = max(1, frame_bytes // bytes_per_block)
    return [(off, min(per, num_blocks - off)) for off in range(0, num_blocks, per)]
