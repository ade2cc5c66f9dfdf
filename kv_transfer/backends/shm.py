"""Same-host CPU backend over a Unix-socket control channel, in one of two modes.

**registered** (one copy; the default when the receiver's cache lies in shared memory,
`kv_transfer.registered`): HELLO asks for it; the receiver answers HELLO_ACK and passes its
cache's memfd (SCM_RIGHTS; the peer's uid was checked, no name exists anywhere). BEGIN is
answered with ACCEPT carrying the write window: the byte offsets of exactly the reserved
blocks. The sender copies its blocks straight into those offsets (a plain copy for runs of
consecutive ids, in pieces of `piece_bytes` with the window's lease and a refusal checked
before each) and commits them with a FRAME header (FLAG_IN_PLACE, no payload, no reply unless
refused): by default one commit for the whole transfer, sent in the same write as END, which
is answered DONE once every block was committed (so a transfer costs the receiver two
wake-ups). With payload checksums a commit covers 16 MiB (verified per commit). On a
connection already up, `start`/`start_stream` send BEGIN on the caller's thread (`_open`), so
the window comes back while the caller goes on (a prefill computing its KV); the transfer
thread reads the ACCEPT waiting for it. The window, its lease and every check are unchanged.
A reservation that ends early revokes the window: the receiver writes CANCEL without waiting
(it is called on the decode worker's event loop); when that cannot go out at once, or a reply
is not taken within `REPLY_SECONDS` (10 s), the receiver cuts the connection: the transfers
begun on it fail, their windows open until the lease plus the grace (a copy may be under way).

**staging** (two copies; for comparison and for a cache that is not in shared memory): the
sender creates one segment per connection (`slots` x `slot_bytes`, random name), sends its
name in HELLO, and unlinks it as soon as the receiver has attached (HELLO_ACK): after the
handshake no name exists, so no process death can leak it. Per frame the sender gathers blocks
into a free slot and sends a FRAME header (aux = slot); the receiver scatters from the slot into
the reserved blocks and answers FRAME_ACK, which frees the slot.

Payload checksums are off by default here (the bytes never leave this host's memory; headers
are always checked); `checksum=True` hashes every frame on both sides.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import select
import socket
import threading
import time
from multiprocessing import shared_memory

import torch

from kv_transfer.backends.shm_receiver import HANDSHAKE_SECONDS, SEGMENT_PREFIX, Receiver
from kv_transfer.blocks import BlockStore
from kv_transfer.control import recv_msg, send_msg, unix_path
from kv_transfer.errors import (
    BackendUnavailableError,
    FrameError,
    PeerError,
    TransferCancelledError,
    TransferError,
    parse_wire_error,
)
from kv_transfer.header import (
    FLAG_IN_PLACE,
    FLAG_IN_SLOT,
    FLAG_NO_CHECKSUM,
    FrameHeader,
    MsgType,
    frame_header,
)
from kv_transfer.interface import (
    DEFAULT_FRAME_BYTES,
    KVSender,
    SendPlan,
    Waiter,
    fill_frame,
)
from kv_transfer.layout import split_hello
from kv_transfer.registered import Grant, SharedRegion, write_granted
from kv_transfer.state import TransferRecord

__all__ = ["Receiver", "Sender", "split_hello"]
MODES = ("auto", "registered", "staging")
# Registered mode, unless frame_bytes is set: bytes one commit covers (each commit wakes the
# receiver: one commit per transfer up to 1 GiB measured 0.85x memcpy against 0.68x for 16 MiB
# commits), and with payload checksums (verified per commit) CHECKED_COMMIT_BYTES.
COMMIT_BYTES = 1 << 30
CHECKED_COMMIT_BYTES = 16 << 20
PIECE_BYTES = 32 << 20  # copied between two checks of the lease and of a refusal
CHECKSUM_DEFAULT = False  # same-host memory: headers checked, payload hashing on request
OPEN_SECONDS = 0.05  # bound on an early BEGIN's write (an idle connection takes it at once)


class Sender(KVSender):
    """`mode`: "registered" (one copy into the receiver's cache; fails unless it is shared),
    "staging" (slots), or "auto" (registered when the receiver offers it, else staging).
    `frame_bytes`: the staging slot size, and in registered mode how many bytes one commit
    covers (default: the whole transfer up to 1 GiB, 16 MiB with checksums; a commit moves no
    bytes, fewer wake the receiver less). `piece_bytes`: registered mode copies at most this
    much between two checks of the window's lease and of a refusal. The handshake ends by
    `connect_deadline` (monotonic), at most HANDSHAKE_SECONDS after the start."""

    def __init__(
        self,
        store: BlockStore,
        address: str,
        *,
        frame_bytes: int | None = None,
        slots: int = 4,
        checksum: bool = CHECKSUM_DEFAULT,
        mode: str = "auto",
        piece_bytes: int = PIECE_BYTES,
        connect_deadline: float | None = None,
    ) -> None:
        super().__init__(store, frame_bytes or DEFAULT_FRAME_BYTES)
        self._commit_bytes = frame_bytes or (CHECKED_COMMIT_BYTES if checksum else COMMIT_BYTES)
        self._piece_bytes = piece_bytes
        if mode not in MODES:
            raise FrameError("mode", f"must be one of {MODES}, got {mode!r}")
        self._path = unix_path(address)
        self._slots = slots
        self.checksum = checksum
        self.mode = mode
        self._conn: socket.socket | None = None
        self._segment: shared_memory.SharedMemory | None = None
        self._ring: torch.Tensor | None = None
        self._window: torch.Tensor | None = None  # registered: the receiver's mapped cache
        self._opened: bytes | None = None  # transfer whose BEGIN `_open` sent on this connection
        self._slot_bytes = self.max_frame_bytes
        self._close_lock = threading.Lock()  # close() runs on the caller's and transfer threads
        self._closed = False  # set by close(): a closed sender never connects again
        # held while a copy into the receiver's window runs: close() waits for it, so once the
        # connection is closed (the receiver's sign that writes ended) nothing more is written
        self._write_lock = threading.Lock()
        handshake = time.monotonic() + HANDSHAKE_SECONDS  # `connect_deadline` may cut it short
        self._connect(handshake if connect_deadline is None else min(handshake, connect_deadline))

    @property
    def blocks_per_frame(self) -> int:
        size = self.frame_bytes if self._window is None else self._commit_bytes
        return max(1, size // self.layout.bytes_per_block)

    @property
    def registered(self) -> bool:
        """True while connected in registered (one-copy) mode."""
        return self._window is not None

    def _handshake(
        self, hello: bytes, deadline: float, *, peer_refusal: bool = False
    ) -> tuple[socket.socket, torch.Tensor | None]:
        """Connect to the receiver, send `hello` and wait for a HELLO_ACK whose layout is
        compatible with ours; returns the connection and, in registered mode, the receiver's
        mapped cache. The connection is closed on any failure. With `peer_refusal`, an ERROR
        reply raises the receiver's own error."""
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            conn.settimeout(max(0.01, deadline - time.monotonic()))
            conn.connect(self._path)
            send_msg(conn, frame_header(MsgType.HELLO, bytes(16), 0, hello), hello)
            header, payload = recv_msg(conn, deadline)
            if peer_refusal and header.msg_type is MsgType.ERROR:
                raise parse_wire_error(bytes(payload))
            if header.msg_type is not MsgType.HELLO_ACK:
                raise PeerError(f"expected HELLO_ACK, got {header.msg_type.name}")
            theirs, extras = split_hello(payload)
            self.layout.check_compatible(theirs)
            registered = extras.get("mode") == "registered"
            window = self._map_window(conn, extras) if registered else None
        except OSError as exc:
            conn.close()
            raise PeerError(f"cannot connect to {self._path}: {exc}") from None
        except BaseException:
            conn.close()
            raise
        return conn, window

    def _connect(self, deadline: float) -> None:
        if self.mode != "staging":
            try:
                self._connect_registered(deadline)
                return
            except BackendUnavailableError:
                if self.mode == "registered":
                    raise
        self._connect_staging(deadline)

    def _connect_registered(self, deadline: float) -> None:
        hello = self._hello({"mode": "registered"})
        conn, window = self._handshake(hello, deadline, peer_refusal=True)
        if window is None:
            conn.close()
            raise PeerError("the receiver answered registered mode without its cache")
        self._conn, self._window = conn, window

    def _connect_staging(self, deadline: float) -> None:
        name = f"{SEGMENT_PREFIX}{os.urandom(8).hex()}"
        segment = shared_memory.SharedMemory(name, create=True, size=self._slots * self._slot_bytes)
        try:
            hello = self._hello({"segment": name, "slot_bytes": self._slot_bytes})
            conn, _ = self._handshake(hello, deadline)
        finally:
            segment.unlink()  # attached by the peer (or refused): the name is no longer needed
        self._conn, self._segment = conn, segment
        self._ring = torch.frombuffer(segment.buf, dtype=torch.uint8)  # [slots * slot_bytes]

    @property
    def stale(self) -> bool:
        """An idle connection the receiver closed (or wrote to): it is of no further use, and
        in registered mode it still maps the receiver's cache, so it must be closed."""
        conn = self._conn
        if conn is None:
            return True
        try:
            return bool(select.select([conn], [], [], 0)[0])
        except (OSError, ValueError):
            return True

    def _hello(self, extras: dict[str, object]) -> bytes:
        return self.layout.to_bytes() + b"\0" + json.dumps(extras).encode()

    def _map_window(self, conn: socket.socket, extras: dict[str, object]) -> torch.Tensor:
        """The receiver's registered cache, mapped here: uint8 [bytes]."""
        return _map_region(conn, extras)

    def close(self) -> None:
        """Close for good (the owner's call): the connection and ring now, and no transfer
        connects again (one started after, or racing, close() fails with PeerError). Idempotent
        and safe from two threads at once."""
        self._closed = True  # before _drop: a reconnect that misses the drop sees the flag
        self._drop()

    def _drop(self) -> None:
        """Close the connection and ring (an aborted transfer's: the next transfer reconnects).
        Idempotent and safe from two threads at once (a transfer aborting on its deadline while
        the owner closes): each resource is taken under the lock, closed once."""
        with self._write_lock, self._close_lock:
            conn, segment = self._conn, self._segment
            self._conn = self._segment = self._ring = self._window = None
            self._opened = None
        if conn is not None:
            conn.close()
        if segment is not None:
            # A transfer thread still inside _run holds a view of the ring; the segment is then
            # unmapped by SharedMemory's finalizer when that view goes (its name is unlinked).
            with contextlib.suppress(BufferError):
                segment.close()

    def _open(self, plan: SendPlan) -> None:
        """BEGIN now, on the caller's thread, when connected (the prefill names its target
        while its engine still computes: the window comes back meanwhile, whenever the transfer
        thread gets to run). A write that does not go through at once closes the connection;
        the transfer thread then reconnects and sends BEGIN itself."""
        conn = self._conn
        if conn is None:
            return
        try:
            conn.settimeout(OPEN_SECONDS)
            self._send_begin(conn, plan)
        except TransferError:
            self._drop()
            return
        self._opened = plan.request.transfer_id

    def _begin(self, conn: socket.socket, plan: SendPlan) -> None:
        """BEGIN for `plan`, unless `_open` already sent it on this connection."""
        opened, self._opened = self._opened, None
        if opened != plan.request.transfer_id:
            self._send_begin(conn, plan)

    @staticmethod
    def _send_begin(conn: socket.socket, plan: SendPlan) -> None:
        tid, epoch, begin = plan.request.transfer_id, plan.request.epoch, plan.begin_payload()
        send_msg(conn, frame_header(MsgType.BEGIN, tid, epoch, begin), begin)

    def _transfer(self, plan: SendPlan, record: TransferRecord, waiter: Waiter) -> None:
        if self._conn is None:
            self._reconnect(min(waiter.deadline, time.monotonic() + HANDSHAKE_SECONDS))
        try:
            if self._window is not None:
                self._run_registered(plan, waiter)
            else:
                self._run(plan, waiter)
        except BaseException as exc:
            self._abort(plan, exc)
            raise

    def _reconnect(self, deadline: float) -> None:
        """Connect anew (an earlier abort dropped the connection), unless the sender was
        closed: then PeerError. A close() during the handshake found nothing to close, so a
        connection made meanwhile is dropped here: its owner is done with the sender and would
        never close it (it kept the receiver's connection thread and, registered, a mapping of
        its cache)."""
        if self._closed:
            raise PeerError("the sender was closed")
        self._connect(deadline)
        if self._closed:  # close() ran during the handshake, before the connection was set
            self._drop()
            raise PeerError("the sender was closed")

    def _abort(self, plan: SendPlan, exc: BaseException) -> None:
        """Tell the receiver (best effort), then drop the connection: its state is unknown."""
        if self._conn is not None and isinstance(exc, TransferError):
            tid, epoch = plan.request.transfer_id, plan.request.epoch
            with contextlib.suppress(TransferError):
                send_msg(self._conn, frame_header(MsgType.CANCEL, tid, epoch))
        self._drop()

    def _run_registered(self, plan: SendPlan, waiter: Waiter) -> None:
        """BEGIN → window; per frame: copy into the window, commit; END → DONE."""
        conn, window = self._connection(), self._window
        if window is None:  # dropped by close() since _transfer looked
            raise PeerError("the sender was closed")
        tid, epoch = plan.request.transfer_id, plan.request.epoch
        self._begin(conn, plan)
        grant = Grant.decode(self._expect_msg(MsgType.ACCEPT, waiter)[1])
        if int(grant.kv.numel()) != int(plan.dst.numel()):
            raise FrameError("grant", f"{grant.kv.numel()} blocks for {plan.dst.numel()}")
        rows = self.store.row_views()
        flags = FLAG_IN_PLACE | (0 if self.checksum else FLAG_NO_CHECKSUM)
        unsent: FrameHeader | None = None  # the last commit goes out with END, in one write
        for index in plan.iter_frames(waiter):
            lo, n = plan.frames[index]
            for a, m in self._pieces(lo, n):
                conn.settimeout(waiter.check())  # a commit blocked on a full socket ends in time
                self._poll_refusal(tid)
                digest = self._write(rows, window, grant, plan.src[a : a + m], a)
            self._publish(window)  # the writes are visible before their commit goes out
            header = FrameHeader(
                MsgType.FRAME, tid, epoch, index, plan.frame_count, lo, n,
                n * self.layout.bytes_per_block, checksum=digest, flags=flags,
            )  # fmt: skip
            if unsent is not None:
                send_msg(conn, unsent)
            unsent = header
        waiter.check()  # a streamed plan stops early on cancel or expiry
        last = b"" if unsent is None else unsent.encode()
        send_msg(conn, *plan.end_frame(), after=last)  # the producer's trailer rides the END
        self._expect(MsgType.DONE, waiter)

    def _write(
        self,
        rows: tuple[torch.Tensor, torch.Tensor | None],
        window: torch.Tensor,
        grant: Grant,
        src: torch.Tensor,
        lo: int,
    ) -> int:
        """One piece into the window, unless the connection was closed meanwhile."""
        with self._write_lock:
            if self._conn is None:
                raise TransferCancelledError("the sender was closed")
            digest = write_granted(rows, window, grant, src, lo, self.checksum)
            self._landed(window)
            return digest

    def _landed(self, window: torch.Tensor) -> None:
        """The piece just written is in the window when this returns (host copies are)."""

    def _pieces(self, lo: int, n: int) -> list[tuple[int, int]]:
        """A commit's blocks `lo .. lo+n` in copies of at most `piece_bytes`, the lease and a
        refusal checked before each (one piece when the commit carries a checksum)."""
        per = n if self.checksum else max(1, self._piece_bytes // self.layout.bytes_per_block)
        return [(a, min(per, lo + n - a)) for a in range(lo, lo + n, per)]

    def _poll_refusal(self, tid: bytes) -> None:
        """Raise at once if the receiver refused a commit or cancelled transfer `tid` (no
        waiting; a revoke of an earlier transfer is ignored)."""
        conn = self._connection()
        while _readable(conn, 0):
            header, payload = recv_msg(conn, time.monotonic() + HANDSHAKE_SECONDS)
            if header.msg_type is not MsgType.CANCEL or header.transfer_id == tid:
                raise _peer_reason(header, payload)

    def _run(self, plan: SendPlan, waiter: Waiter) -> None:
        conn, ring = self._connection(), self._ring
        if ring is None:  # dropped by close() since _transfer looked
            raise PeerError("the sender was closed")
        self._begin(conn, plan)
        self._expect(MsgType.ACCEPT, waiter)
        free = list(range(self._slots))
        for index in plan.iter_frames(waiter):
            waiter.check()
            while not free:
                free.append(self._expect(MsgType.FRAME_ACK, waiter).aux)
            slot = free.pop()
            buf = ring[slot * self._slot_bytes : (slot + 1) * self._slot_bytes]
            header, _ = fill_frame(self.store, plan, index, buf, self.checksum)
            self._publish(buf)
            send_msg(conn, dataclasses.replace(header, aux=slot, flags=header.flags | FLAG_IN_SLOT))
        for _ in range(self._slots - len(free)):
            self._expect(MsgType.FRAME_ACK, waiter)
        waiter.check()  # a streamed plan stops early on cancel or expiry
        send_msg(conn, *plan.end_frame())
        self._expect(MsgType.DONE, waiter)

    def _connection(self) -> socket.socket:
        """The connection; PeerError once close() (or an abort) dropped it: a transfer whose
        sender was closed under it fails as one whose connection broke."""
        conn = self._conn
        if conn is None:
            raise PeerError("the sender was closed")
        return conn

    def _publish(self, slot: torch.Tensor) -> None:
        """Make a filled slot visible to the receiver before its FRAME header goes out."""

    def _expect(self, kind: MsgType, waiter: Waiter) -> FrameHeader:
        return self._expect_msg(kind, waiter)[0]

    def _expect_msg(self, kind: MsgType, waiter: Waiter) -> tuple[FrameHeader, bytearray]:
        """Next message must be `kind`; ERROR and CANCEL raise the peer's reason."""
        while True:
            left = waiter.check()
            conn = self._connection()  # each slice: close() may have dropped it meanwhile
            if not _readable(conn, min(left, 0.05)):  # poll slice: re-check cancel and deadline
                continue
            header, payload = recv_msg(conn, waiter.deadline)
            if header.msg_type is kind:
                return header, payload
            raise _peer_reason(header, payload, kind)


def _readable(conn: socket.socket, timeout: float) -> bool:
    """Whether `conn` has something to read within `timeout` s; PeerError when it was closed
    (by close() on another thread) before or during the wait."""
    try:
        return bool(select.select([conn], [], [], timeout)[0])
    except (OSError, ValueError):  # ValueError: a closed socket's descriptor is -1
        raise PeerError("the sender was closed") from None


def _map_region(conn: socket.socket, extras: dict[str, object]) -> torch.Tensor:
    """Receive the descriptor of the receiver's cache (SCM_RIGHTS) and map it: uint8 [bytes]."""
    size = extras.get("bytes")
    if not isinstance(size, int) or size <= 0:
        raise FrameError("bytes", f"must be a positive int, got {size!r}")
    _, fds, _, _ = socket.recv_fds(conn, 1, 1)
    if len(fds) != 1:
        raise PeerError("the receiver passed no cache descriptor")
    region = SharedRegion(size, fds[0])
    region.close()  # mapped: the descriptor is no longer needed
    return region.bytes


def _peer_reason(
    header: FrameHeader, payload: bytearray, expected: MsgType | None = None
) -> TransferError:
    """The error an unexpected message from the receiver stands for."""
    if header.msg_type is MsgType.ERROR:
        return parse_wire_error(bytes(payload))
    if header.msg_type is MsgType.CANCEL:
        return TransferCancelledError("cancelled by the receiver")
    wanted = expected.name if expected is not None else "nothing"
    return PeerError(f"expected {wanted}, got {header.msg_type.name}")
