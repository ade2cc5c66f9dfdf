"""Receiver side shared by every backend: reservations, fencing, validation and scatter.

A transfer may write only into blocks reserved for it by `expect(request, dst_ids, deadline)`;
frames whose transfer id is unknown or whose epoch differs are refused without touching any
reservation (a stale or restarted peer never writes into blocks it no longer owns).

A transfer's blocks may arrive in any number of frames, in any order (a streamed transfer sends
each prefill chunk's blocks as the chunk completes): every frame names its block offset, frame
indices are unique, and the transfer completes at END only when every reserved block has been
written exactly once. A frame that overlaps blocks already written is refused.

Registered memory (`grant`, `on_written`): when the cache lies in a shared region, BEGIN is
answered with a write window over exactly the reserved blocks (their byte offsets, bound to
the transfer id, epoch and lease); the sender writes the blocks in place and commits each
frame. A commit for another epoch, after the lease, outside the window or over blocks already
committed is refused and changes nothing; END completes only when every block was committed.

A granted window stays open until the sender is known to have stopped writing: its END, its
CANCEL, its connection closing (`window_closed`, under the epoch that connection was granted
the window; a connection the receiver cut itself closes none), or the reservation's deadline
plus `WINDOW_GRACE_SECONDS` (`ReceiveHandle.close_window_if_due`: a sender never starts a copy
after its grant's lease). Cancelling a transfer only asks the sender to stop (a copy under way
finishes), so blocks whose window is open must not be reused: `ReceiveHandle.quiet` and
`when_quiet` say when they can be.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import time
from collections.abc import Callable, Iterable

import torch

from kv_transfer.blocks import BlockStore, as_ids
from kv_transfer.errors import (
    ChecksumError,
    FrameError,
    PeerError,
    StaleEpochError,
    TransferCancelledError,
    TransferError,
    TransferStateError,
    UnknownTransferError,
    unraised,
)
from kv_transfer.header import FLAG_NO_CHECKSUM, FLAG_NO_KV, MAX_TRAILER, FrameHeader
from kv_transfer.registered import Grant, rows_checksum
from kv_transfer.state import TransferRecord, TransferRequest, TransferResult, TransferState

_RECENT = 1024  # ended transfers remembered, so late frames get the real reason
WINDOW_GRACE_SECONDS = 1.0  # after a grant's deadline, beyond any copy it let start


@dataclasses.dataclass
class _Reservation:
    record: TransferRecord
    dst: torch.Tensor  # int64 [n] destination block ids reserved for this transfer
    frames_seen: set[int] = dataclasses.field(default_factory=set)
    frame_count: int | None = None
    blocks_written: int = 0
    written: torch.Tensor | None = None  # bool [n]: destination blocks already written
    revoke: Callable[[], None] | None = None  # tells a sender holding a window to stop
    window_open: bool = False  # a sender was granted a window and may still write into it
    on_quiet: list[Callable[[], object]] = dataclasses.field(default_factory=list)


class ReceiveHandle:
    """One reserved destination: wait for completion, or cancel it (no writes after cancel)."""

    def __init__(self, core: ReceiverCore, reservation: _Reservation) -> None:
        self._core = core
        self._res = reservation

    @property
    def state(self) -> TransferState:
        return self._res.record.state

    def wait(self, timeout: float | None = None) -> TransferResult:
        """Block until terminal or the reservation deadline (then EXPIRED); `wait(0.0)` is
        the result now."""
        result = self._res.record.wait(timeout)
        if result.state.is_terminal:
            self._core.forget(self._res)
        return result

    def when_done(self, callback: Callable[[], object]) -> None:
        """Call `callback()` once the transfer is terminal: now when it is, else on the thread
        that ends it (a receiver's thread, a cancel, the expiry), under the transfer's lock: it
        must be quick (queue a command, post to a loop)."""
        self._res.record.when_terminal(callback)

    @property
    def ended(self) -> float | None:
        """Monotonic time the transfer became terminal (None while it is not)."""
        return self._res.record.ended

    def expire_if_due(self) -> bool:
        """End as EXPIRED once the reservation's deadline passed (waking `when_done`);
        True when the transfer is (now) terminal. Cheap once terminal: the reaper asks on
        every tick for as long as the request decodes."""
        if self._res.record.state.is_terminal:
            return True
        terminal = self._res.record.expire_if_due()
        if terminal:
            self._forget_and_revoke()
        return terminal

    @property
    def quiet(self) -> bool:
        """No write into the reserved blocks can come any more: the transfer ended and no
        sender holds an open window into them."""
        with self._res.record.lock:
            return self._res.record.state.is_terminal and not self._res.window_open

    def when_quiet(self, callback: Callable[[], object]) -> None:
        """Call `callback()` once `quiet`: now when it is, else on the thread that ends the
        transfer or closes its window (a receiver's connection thread, a cancel, or
        `close_window_if_due`'s caller); it must be quick (queue a command, post to a loop)."""
        res = self._res

        def settle() -> None:  # terminal now
            with res.record.lock:  # against close_window swapping on_quiet meanwhile
                if res.window_open:
                    res.on_quiet.append(callback)
                    return
            callback()

        res.record.when_terminal(settle)

    def close_window_if_due(self, now: float | None = None) -> bool:
        """Close an open window once the reservation's deadline plus WINDOW_GRACE_SECONDS
        passed (the sender stopped by then: it never starts a copy after its grant's lease);
        True when the handle is (now) quiet."""
        now = time.monotonic() if now is None else now
        if self._res.window_open and now >= self._res.record.deadline + WINDOW_GRACE_SECONDS:
            self._core.close_window(self._res)
        return self.quiet

    def cancel(self) -> bool:
        """End as CANCELLED unless already terminal; an in-progress write finishes first.
        A sender holding a window (registered memory) is told to stop; until it has (`quiet`)
        the blocks may still change."""
        ended = self._res.record.end(TransferState.CANCELLED)
        self._forget_and_revoke()
        return ended

    def _forget_and_revoke(self) -> None:
        self._core.forget(self._res)
        if self._res.revoke is not None and self._res.record.state is not TransferState.COMPLETED:
            self._res.revoke()  # a sender may still hold a write window: stop it


def _ended_error(record: TransferRecord) -> TransferError:
    """What a message for an ended transfer is refused with: a fresh copy of its error (a
    raise of the kept one would grow its traceback by the frames of each late message)."""
    if record.error is None:
        return TransferStateError(f"transfer already {record.state.name}")
    return unraised(record.error)


class ReceiverCore:
    def __init__(self, store: BlockStore) -> None:
        self.store = store
        self._lock = threading.Lock()
        self._reservations: dict[bytes, _Reservation] = {}
        self._recent: collections.OrderedDict[bytes, TransferRecord] = collections.OrderedDict()
        self._windows: dict[tuple[bytes, int], _Reservation] = {}  # open, by (id, epoch)

    def expect(
        self, request: TransferRequest, dst_block_ids: object, deadline: float
    ) -> ReceiveHandle:
        """Reserve: accept exactly this transfer id and epoch into `dst_block_ids` by deadline."""
        dst = as_ids(dst_block_ids, "dst_block_ids")
        self.store.check_ids(dst, "dst_block_ids")
        if int(torch.unique(dst).numel()) != int(dst.numel()):
            raise FrameError("dst_block_ids", "duplicate block ids")
        res = _Reservation(TransferRecord(request, int(dst.numel()), deadline), dst)
        with self._lock:
            if request.transfer_id in self._reservations:
                raise TransferStateError("transfer_id already reserved")
            self._reservations[request.transfer_id] = res
        return ReceiveHandle(self, res)

    def forget(self, res: _Reservation) -> None:
        with self._lock:
            tid = res.record.request.transfer_id
            if self._reservations.get(tid) is res:
                del self._reservations[tid]
                self._recent[tid] = res.record
                while len(self._recent) > _RECENT:
                    self._recent.popitem(last=False)

    def _find(self, header: FrameHeader) -> _Reservation:
        with self._lock:
            res = self._reservations.get(header.transfer_id)
            ended = self._recent.get(header.transfer_id) if res is None else None
        if ended is not None and ended.request.epoch == header.epoch:
            raise _ended_error(ended)
        if res is None:
            raise UnknownTransferError(f"transfer {header.transfer_id.hex()} not reserved here")
        if header.epoch != res.record.request.epoch:
            raise StaleEpochError(
                f"epoch {header.epoch} != reserved epoch {res.record.request.epoch}"
            )
        if res.record.expire_if_due():
            self.forget(res)
            raise _ended_error(res.record)
        return res

    def _fail(self, res: _Reservation, error: TransferError) -> TransferError:
        res.record.end(TransferState.FAILED, error)
        self.forget(res)
        return error

    def on_begin(self, header: FrameHeader, dst_payload: bytes | bytearray | memoryview) -> None:
        """Sender announces the transfer and the destination ids it believes were reserved."""
        res = self._find(header)
        if not len(dst_payload) or len(dst_payload) % 4:
            raise self._fail(res, FrameError("dst_block_ids", "empty, or not whole int32 ids"))
        theirs = torch.frombuffer(bytearray(dst_payload), dtype=torch.int32).to(torch.int64)
        with res.record.lock:
            if res.record.state is not TransferState.PENDING:
                raise TransferStateError(f"BEGIN in state {res.record.state.name}")
            if not torch.equal(theirs, res.dst):
                raise self._fail(res, FrameError("dst_block_ids", "differ from the reservation"))
            res.record.move(TransferState.IN_FLIGHT)

    def grant(
        self,
        header: FrameHeader,
        dst_payload: bytes | bytearray,
        revoke: Callable[[], None] | None = None,
    ) -> bytes:
        """BEGIN on registered memory: the encoded write window over the reserved blocks;
        `revoke` is called when the reservation is cancelled or dropped before completing."""
        if not self.store.grantable:
            raise FrameError("mode", "this receiver's cache is not in shared memory")
        self.on_begin(header, dst_payload)
        res = self._find(header)
        with res.record.lock:  # a cancel from now on revokes; one before refuses the grant
            if res.record.state is not TransferState.IN_FLIGHT:
                raise TransferStateError(f"BEGIN ended in state {res.record.state.name}")
            res.revoke = revoke
            res.window_open = True
            with self._lock:
                self._windows[header.transfer_id, header.epoch] = res
        kv, scales = self.store.region_offsets(res.dst)
        left = res.record.deadline - time.monotonic()
        return Grant(kv, scales, res.record.deadline).encode(left)

    def window_closed(self, transfer_id: bytes, epoch: int | None = None) -> None:
        """The sender granted the window of `transfer_id` under `epoch` stopped writing into it
        (its END or CANCEL, or its connection closed); a no-op when no window is open for it
        under that epoch (None: under any). Only the granted connection may call it, naming
        the epoch it was granted under: a window of the same id granted to another sender
        under another epoch stays open."""
        with self._lock:
            if epoch is None:
                found = [r for (tid, _), r in self._windows.items() if tid == transfer_id]
            else:
                found = [r for r in [self._windows.get((transfer_id, epoch))] if r is not None]
        for res in found:
            self.close_window(res)

    def close_window(self, res: _Reservation) -> None:
        """Mark `res`'s window closed and run its `when_quiet` callbacks (once). A transfer
        still live when its sender stopped (its connection closed) ends FAILED first."""
        if not res.record.expire_if_due():
            self._fail(res, PeerError("the sender stopped writing before END"))
        with res.record.lock:
            if not res.window_open:
                return
            res.window_open = False
            callbacks, res.on_quiet = res.on_quiet, []
        key = (res.record.request.transfer_id, res.record.request.epoch)
        with self._lock:
            if self._windows.get(key) is res:
                del self._windows[key]
        for callback in callbacks:
            callback()

    def on_written(self, header: FrameHeader) -> None:
        """A sender committed blocks it wrote in place; refused (nothing changes) unless the
        transfer is live under this epoch and lease and the blocks are inside the window, not
        yet committed, and (unless FLAG_NO_CHECKSUM) match the frame's checksum."""
        res = self._find(header)
        with res.record.lock:  # cancel() waits for a commit in progress, then none follows
            if res.record.state is not TransferState.IN_FLIGHT:
                raise TransferStateError(f"FRAME in state {res.record.state.name}")
            self._check_window(res, header)
            lo, n = header.block_offset, header.num_blocks
            if not header.flags & FLAG_NO_CHECKSUM:
                self._verify_in_place(res.dst[lo : lo + n], header)
            self._mark(res, header)

    def _verify_in_place(self, ids: torch.Tensor, header: FrameHeader) -> None:
        region = self.store.region
        if region is None:
            raise FrameError("flags", "payload checksums need a host cache")
        kv, scales = self.store.region_offsets(ids)
        groups = [(region.bytes, kv, self.store.layout.kv_bytes_per_block)]
        if scales is not None:
            groups.insert(0, (region.bytes, scales, self.store.layout.scales_bytes_per_block))
        actual = rows_checksum(groups)
        if actual != header.checksum:
            raise ChecksumError("checksum", f"blocks {actual:#x} != header {header.checksum:#x}")

    def _mark(self, res: _Reservation, header: FrameHeader) -> None:
        lo, n = header.block_offset, header.num_blocks
        res.frames_seen.add(header.frame_index)
        res.frame_count = header.frame_count
        assert res.written is not None  # set by _check_window
        res.written[lo : lo + n] = True
        res.blocks_written += n
        res.record.num_bytes += header.payload_len

    def on_frame(self, header: FrameHeader, payload: torch.Tensor) -> None:
        """Validate one FRAME (uint8 payload [payload_len]) and scatter it into reserved blocks."""
        res = self._find(header)
        with res.record.lock:  # held across the write: cancel() waits for it, then no more writes
            if res.record.state is not TransferState.IN_FLIGHT:
                raise TransferStateError(f"FRAME in state {res.record.state.name}")
            try:
                self._check_window(res, header)
                self._check_payload(header, payload)
            except TransferError as exc:
                raise self._fail(res, exc) from None
            lo, n = header.block_offset, header.num_blocks
            self.store.scatter_from(res.dst[lo : lo + n], payload)
            self._mark(res, header)

    def _check_window(self, res: _Reservation, header: FrameHeader) -> None:
        if res.frame_count not in (None, header.frame_count):
            raise FrameError("frame_count", f"changed from {res.frame_count}")
        if header.frame_index in res.frames_seen:
            raise FrameError("frame_index", f"frame {header.frame_index} repeated")
        total = int(res.dst.numel())
        if header.num_blocks == 0 or header.block_offset + header.num_blocks > total:
            raise FrameError("block_offset", f"blocks outside the reserved set of {total}")
        if res.written is None:
            res.written = torch.zeros(total, dtype=torch.bool)
        lo, hi = header.block_offset, header.block_offset + header.num_blocks
        if bool(res.written[lo:hi].any()):
            raise FrameError(
                "block_offset", f"blocks {lo}..{hi - 1} overlap blocks already written"
            )
        want = header.num_blocks * self.store.layout.bytes_per_block
        if header.payload_len != want:
            raise FrameError("payload_len", f"{header.payload_len} != {want} for the blocks")

    @staticmethod
    def _check_payload(header: FrameHeader, payload: torch.Tensor) -> None:
        if payload.device.type == "cpu":
            header.verify_payload(payload.numpy())
        elif header.flags & FLAG_NO_CHECKSUM:  # device payload: length only, no host copy
            if payload.numel() != header.payload_len:
                raise FrameError("payload_len", f"{header.payload_len} != {payload.numel()}")
        else:
            header.verify_payload(payload.cpu().numpy())

    def on_end(
        self, header: FrameHeader, trailer: bytes | bytearray | memoryview = b""
    ) -> TransferResult:
        """Sender finished: COMPLETED when every reserved block was written exactly once (in
        however many frames; `frame_count` is an upper bound for a streamed transfer), or with
        FLAG_NO_KV whatever was written (`kv_complete` False: the producer had no KV to ship).
        `trailer` (the END payload, at most MAX_TRAILER bytes) is kept for the result."""
        res = self._find(header)
        with res.record.lock:
            if res.record.state is not TransferState.IN_FLIGHT:
                raise TransferStateError(f"END in state {res.record.state.name}")
            if len(trailer) > MAX_TRAILER:
                raise self._fail(res, FrameError("payload_len", f"trailer above {MAX_TRAILER}"))
            no_kv = bool(header.flags & FLAG_NO_KV)
            if not no_kv and res.blocks_written != int(res.dst.numel()):
                raise self._fail(res, FrameError("frame_count", "END before every frame"))
            res.record.trailer = bytes(trailer)
            res.record.kv_complete = not no_kv
            res.record.move(TransferState.COMPLETED)
        self.forget(res)
        self.close_window(res)  # END follows the sender's last write
        return res.record.result()

    def on_cancel(self, header: FrameHeader) -> None:
        """The sender cancelled: end CANCELLED (a stale peer's CANCEL is refused by `_find`)."""
        res = self._find(header)
        res.record.end(TransferState.CANCELLED)
        self.forget(res)

    def on_broken_off(self, header: FrameHeader, error: TransferError) -> None:
        """The stream that began `header`'s transfer ended without END or CANCEL: end the
        transfer now, CANCELLED for a `TransferCancelledError` (the sender gave up), else
        FAILED with `error`; no-op once terminal. Fenced like a frame: for an unknown id or
        another epoch nothing changes."""
        try:
            res = self._find(header)
        except TransferError:
            return
        cancelled = isinstance(error, TransferCancelledError)
        res.record.end(TransferState.CANCELLED if cancelled else TransferState.FAILED, error)
        self.forget(res)

    def fail_ids(self, begun: Iterable[tuple[bytes, int]], error: TransferError) -> None:
        """A connection died: fail the transfers it had begun, `(transfer id, epoch)` pairs,
        that are still IN_FLIGHT under that epoch (a reservation of the same id under another
        epoch is another sender's: untouched); one whose reservation deadline already passed
        ends EXPIRED (the lease ended first: a peer that stopped past it reads as expired,
        however late its connection is found broken)."""
        keys = set(begun)
        with self._lock:
            reservations = [
                r for t, r in self._reservations.items() if (t, r.record.request.epoch) in keys
            ]
        for res in reservations:
            if res.record.state is not TransferState.IN_FLIGHT:
                continue
            if res.record.expire_if_due():
                self.forget(res)
            else:
                self._fail(res, error)
