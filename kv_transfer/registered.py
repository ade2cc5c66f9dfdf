"""Registered receiver memory: a KV cache that lives in an anonymous shared mapping, and the
write windows a receiver grants over it.

A `SharedRegion` is a memfd (no name in any filesystem) mapped into this process; a cache and
its scales are tensors over it (`shared_block_store`). The receiver hands the descriptor to a
same-uid peer over its Unix socket (SCM_RIGHTS) at the handshake, so nothing can leak by name.
The memfd is sealed at its size once made: a peer holding the descriptor cannot shrink it
(every page this process touched past the new end would fault: SIGBUS) or grow it.

A `Grant` is what a sender may write: for each reserved block (in reservation order) the byte
offset of its KV row, and of its scales row when the cache has scales, plus the seconds left
on the reservation when it was granted. The sender never learns block ids of the receiver's
cache, only these offsets; `write_granted` copies its source blocks straight into them (one
copy, the same `index_select` gather the staging path uses, with the window as its output).

Grant payload (little-endian): `f64 seconds_left, u32 n, u32 has_scales, i64 kv[n]`
`[, i64 scales[n]]`.
"""

from __future__ import annotations

import dataclasses
import fcntl
import itertools
import mmap
import os
import struct
import time

import torch
import xxhash

from kv_transfer.errors import DeadlineExpiredError, FrameError

_GRANT_HEAD = struct.Struct("<dII")
GRANT_MARGIN_SECONDS = 0.05  # a sender stops writing this long before its grant ends


class SharedRegion:
    """`nbytes` of anonymous shared memory (memfd) mapped read-write into this process."""

    def __init__(self, nbytes: int, fd: int | None = None) -> None:
        if nbytes <= 0:
            raise FrameError("region_bytes", f"must be positive, got {nbytes}")
        own = fd is None
        if fd is None:
            fd = os.memfd_create("kvmesh-kv", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        self.fd = fd
        try:
            if own:  # sized, then sealed: no holder of the descriptor can resize it under us
                os.ftruncate(self.fd, nbytes)
                seals = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
                fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, seals)
            elif os.fstat(self.fd).st_size < nbytes:
                raise FrameError("region_bytes", "the shared region is smaller than announced")
            flags = mmap.MAP_SHARED | (0 if own else getattr(mmap, "MAP_POPULATE", 0))
            self._mmap = mmap.mmap(self.fd, nbytes, flags)  # a peer's: page tables filled now
        except BaseException:
            os.close(self.fd)
            raise
        self.nbytes = nbytes
        self.bytes = torch.frombuffer(self._mmap, dtype=torch.uint8)  # [nbytes]

    def tensor(self, offset: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A view of the region at `offset` (aligned to the element size)."""
        count = int(torch.Size(shape).numel()) * torch.empty(0, dtype=dtype).element_size()
        return self.bytes[offset : offset + count].view(dtype).view(shape)

    def offset_of(self, tensor: torch.Tensor) -> int:
        """Byte offset of `tensor`'s first element inside the region (FrameError if outside)."""
        offset = tensor.data_ptr() - self.bytes.data_ptr()
        end = offset + tensor.numel() * tensor.element_size()
        if offset < 0 or end > self.nbytes:
            raise FrameError("cache", "tensor does not lie in the shared region")
        return offset

    def close(self) -> None:
        """Drop this process's descriptor; the mapping lives as long as tensors view it."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def _aligned(n: int, to: int = 4096) -> int:
    return -(-n // to) * to


def shared_tensors(
    shape: tuple[int, ...], dtype: torch.dtype, scales_shape: tuple[int, ...] | None = None
) -> tuple[torch.Tensor, torch.Tensor | None, SharedRegion]:
    """Zeroed cache `[num_blocks, ...]` (and float32 scales, set to 1.0) in one region."""
    kv_bytes = int(torch.Size(shape).numel()) * torch.empty(0, dtype=dtype).element_size()
    scale_bytes = 0 if scales_shape is None else int(torch.Size(scales_shape).numel()) * 4
    region = SharedRegion(_aligned(kv_bytes) + max(scale_bytes, 1))
    cache = region.tensor(0, shape, dtype)
    scales = None
    if scales_shape is not None:
        scales = region.tensor(_aligned(kv_bytes), scales_shape, torch.float32)
        scales.fill_(1.0)
    return cache, scales, region


@dataclasses.dataclass(frozen=True)
class Grant:
    """A write window over one reservation's blocks (offsets in reservation order)."""

    kv: torch.Tensor  # int64 [n] byte offsets of the KV rows
    scales: torch.Tensor | None  # int64 [n] byte offsets of the scales rows
    expires: float  # this process's monotonic time after which nothing may be written

    def encode(self, seconds_left: float) -> bytes:
        head = _GRANT_HEAD.pack(seconds_left, int(self.kv.numel()), self.scales is not None)
        tail = b"" if self.scales is None else self.scales.numpy().tobytes()
        return head + self.kv.numpy().tobytes() + tail

    @classmethod
    def decode(cls, payload: bytes | bytearray) -> Grant:
        """Parse a grant; its expiry is the seconds left, less a margin, from now."""
        if len(payload) < _GRANT_HEAD.size:
            raise FrameError("grant", "too short")
        left, n, has_scales = _GRANT_HEAD.unpack_from(payload)
        body = memoryview(payload)[_GRANT_HEAD.size :]
        if has_scales not in (0, 1) or body.nbytes != 8 * n * (1 + has_scales):
            raise FrameError("grant", f"{body.nbytes} offset bytes for {n} blocks")
        offsets = torch.frombuffer(bytearray(body), dtype=torch.int64)
        scales = offsets[n:] if has_scales else None
        return cls(offsets[:n], scales, time.monotonic() + left - GRANT_MARGIN_SECONDS)

    def check(self) -> None:
        if time.monotonic() >= self.expires:
            raise DeadlineExpiredError("write window expired (the reservation's lease ran out)")


def _runs(offsets: torch.Tensor, row_bytes: int) -> list[tuple[int, int]]:
    """Split offsets into runs of adjacent rows: [(first index, length)]."""
    if offsets.numel() == 0:
        return []
    steps = (offsets[1:] - offsets[:-1]) != row_bytes
    cuts = [0, *(torch.nonzero(steps).reshape(-1) + 1).tolist(), int(offsets.numel())]
    return [(a, b - a) for a, b in itertools.pairwise(cuts)]


def write_rows(
    window: torch.Tensor, offsets: torch.Tensor, src_rows: torch.Tensor, src_ids: torch.Tensor
) -> None:
    """`window[offsets[i]:][:row] = src_rows[src_ids[i]]` for every i, one copy per byte:
    each run of adjacent destination rows is one copy into the window (a plain copy when the
    source rows are a run too, else an `index_select`)."""
    row = int(src_rows.shape[1])
    for first, n in _runs(offsets, row):
        start = int(offsets[first])
        if start < 0 or start + n * row > window.numel():
            raise FrameError("grant", "offset outside the shared region")
        out = window[start : start + n * row].view(n, row)
        ids = src_ids[first : first + n]  # int64 [n], on the host
        if out.device == src_rows.device and consecutive(ids):  # one run: a plain copy
            lo = int(ids[0])
            out.copy_(src_rows[lo : lo + n])
            continue
        ids = ids.to(src_rows.device)
        if out.device == src_rows.device:
            torch.index_select(src_rows, 0, ids, out=out)
        else:  # another GPU of this node (CUDA IPC): gather there, then one peer copy
            out.copy_(torch.index_select(src_rows, 0, ids))


def consecutive(ids: torch.Tensor) -> bool:
    """Whether block ids (int64 [n]) are one run `a, a+1, ...`."""
    return ids.numel() < 2 or bool((ids[1:] - ids[:-1] == 1).all())


def rows_checksum(groups: list[tuple[torch.Tensor, torch.Tensor, int]]) -> int:
    """xxh3_64 over `(flat uint8 memory, row offsets, row bytes)` groups, rows in order: with
    the scales group first, the checksum of the staged payload `[scales][kv]` of the blocks."""
    hasher = xxhash.xxh3_64()
    for window, offsets, row in groups:
        data = window.numpy()
        for first, n in _runs(offsets, row):
            start = int(offsets[first])
            hasher.update(data[start : start + n * row])  # type: ignore[arg-type]
    return hasher.intdigest()


def write_granted(
    src_rows: tuple[torch.Tensor, torch.Tensor | None],
    window: torch.Tensor,
    grant: Grant,
    src_ids: torch.Tensor,
    lo: int,
    checksum: bool,
) -> int:
    """Copy source blocks `src_ids` (uint8 rows `src_rows`: KV, scales) into the granted
    blocks `lo ..`; return the xxh3_64 of their source bytes (scales first), 0 without
    `checksum`."""
    grant.check()
    n = int(src_ids.numel())
    kv_rows, scale_rows = src_rows
    write_rows(window, grant.kv[lo : lo + n], kv_rows, src_ids)
    groups = [(kv_rows.view(-1), src_ids * int(kv_rows.shape[1]), int(kv_rows.shape[1]))]
    if scale_rows is not None:
        if grant.scales is None:
            raise FrameError("grant", "the receiver's cache has no scales")
        write_rows(window, grant.scales[lo : lo + n], scale_rows, src_ids)
        row = int(scale_rows.shape[1])
        groups.insert(0, (scale_rows.view(-1), src_ids * row, row))
    return rows_checksum(groups) if checksum else 0
