"""Same-host CPU backend over a Unix-socket control channel, in one of two modes.

**registered** (one copy; the default when the receiver's cache lies in shared memory,
`kv_transfer.registered`): HELLO asks for it; the receiver answers HELLO_ACK and passes its
cache's memfd (SCM_RIGHTS; the peer's uid was checked, no name exists anywhere). BEGIN is
answered with ACCEPT carrying the write window: the byte offsets of exactly the reserved
blocks. Per frame the sender copies its blocks straight into those offsets and commits them
with a FRAME header (FLAG_IN_PLACE, no payload, no reply unless refused); END is answered DONE
once every block was committed. The sender checks its window's lease before every write.

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

import _posixshmem
import contextlib
import dataclasses
import json
import mmap
import os
import select
import socket
import threading
import time
from multiprocessing import shared_memory

import torch

from kv_transfer.blocks import BlockStore
from kv_transfer.control import recv_msg, send_msg, unix_path
from kv_transfer.errors import (
    BackendUnavailableError,
    FrameError,
    PeerError,
    TransferCancelledError,
    TransferError,
    error_to_wire,
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
    KVReceiver,
    KVSender,
    SendPlan,
    Waiter,
    fill_frame,
)
from kv_transfer.layout import KVLayout
from kv_transfer.registered import Grant, SharedRegion, write_granted
from kv_transfer.state import TransferRecord
from kv_transfer.unix_server import UnixServer

HANDSHAKE_SECONDS = 10.0
IDLE_SECONDS = 600.0  # an idle connection is closed; the sender reconnects on its next send
SEGMENT_PREFIX = "kvmesh_"
MODES = ("auto", "registered", "staging")
COMMIT_BYTES = 16 << 20  # registered mode: bytes one commit covers unless frame_bytes is set
CHECKSUM_DEFAULT = False  # same-host memory: headers checked, payload hashing on request


def _split_hello(payload: bytes | bytearray) -> tuple[KVLayout, dict[str, object]]:
    layout_bytes, _, extra = bytes(payload).partition(b"\0")
    try:
        extras = json.loads(extra or b"{}")
    except ValueError:
        raise FrameError("hello", "bad extras") from None
    if not isinstance(extras, dict):
        raise FrameError("hello", "bad extras")
    return KVLayout.from_bytes(layout_bytes), extras


class Receiver(KVReceiver):
    def __init__(self, store: BlockStore) -> None:
        super().__init__(store)
        self._server = UnixServer(self._serve, "kv-shm")

    @property
    def address(self) -> str:
        return self._server.address

    def close(self) -> None:
        self._server.close()

    def _serve(self, conn: socket.socket) -> None:
        header, payload = recv_msg(conn, time.monotonic() + HANDSHAKE_SECONDS)
        if header.msg_type is not MsgType.HELLO:
            raise FrameError("msg_type", f"expected HELLO, got {header.msg_type.name}")
        theirs, extras = _split_hello(payload)
        ours = self.layout.to_bytes()
        if theirs != self.layout:  # the sender raises the mismatch from our layout
            send_msg(conn, frame_header(MsgType.HELLO_ACK, bytes(16), 0, ours), ours)
            self.layout.check_compatible(theirs)
        if extras.get("mode") == "registered":
            self._serve_registered(conn, ours)
            return
        slot_bytes = extras.get("slot_bytes")
        if not isinstance(slot_bytes, int) or slot_bytes <= 0:
            raise FrameError("slot_bytes", f"must be a positive int, got {slot_bytes!r}")
        segment = _Attached(str(extras.get("segment", "")))
        send_msg(conn, frame_header(MsgType.HELLO_ACK, bytes(16), 0, ours), ours)
        ring = torch.frombuffer(segment.buf, dtype=torch.uint8)  # [slots * slot_bytes]
        try:
            self._loop(conn, ring, slot_bytes)
        finally:
            del ring  # the tensor must not outlive the mapping
            segment.close()

    def _serve_registered(self, conn: socket.socket, ours: bytes) -> None:
        """Register the cache with the peer after HELLO_ACK; then grant windows per transfer."""
        try:
            extras, fds = self._registration()
        except BackendUnavailableError as error:
            wire = error_to_wire(error)
            send_msg(conn, frame_header(MsgType.ERROR, bytes(16), 0, wire), wire)
            raise
        ack = ours + b"\0" + json.dumps({"mode": "registered", **extras}).encode()
        send_msg(conn, frame_header(MsgType.HELLO_ACK, bytes(16), 0, ack), ack)
        if fds:
            try:
                socket.send_fds(conn, [b"F"], fds)
            except OSError as exc:
                raise PeerError(f"cannot pass the cache descriptor: {exc}") from None
        self._loop(conn, None, 0)

    def _registration(self) -> tuple[dict[str, object], list[int]]:
        """HELLO_ACK extras and descriptors that let the peer map this cache (SCM_RIGHTS)."""
        region = self.store.region
        if region is None:
            raise BackendUnavailableError("the receiver's cache is not in shared memory")
        return {"bytes": region.nbytes}, [region.fd]

    def _loop(self, conn: socket.socket, ring: torch.Tensor | None, slot_bytes: int) -> None:
        """Serve one connection; `ring` None: registered mode (grants and commits)."""
        begun = _Begun(conn)
        can_reply = True  # after a failed reply keep reading: a CANCEL may still be buffered
        try:
            while True:
                header, payload = recv_msg(conn, time.monotonic() + IDLE_SECONDS)
                reply = self._dispatch(header, payload, ring, slot_bytes, begun)
                if reply is not None and can_reply:
                    try:
                        begun.send(*reply)
                    except PeerError:
                        can_reply = False
        except TransferError as exc:
            self.core.fail_ids(begun, PeerError(f"sender connection lost: {exc}"))
            raise

    def _dispatch(
        self,
        header: FrameHeader,
        payload: bytearray,
        ring: torch.Tensor | None,
        slot_bytes: int,
        begun: set[bytes],
    ) -> tuple[FrameHeader, bytes] | None:
        tid, epoch, kind = header.transfer_id, header.epoch, header.msg_type
        try:
            if kind is MsgType.BEGIN and ring is None:
                assert isinstance(begun, _Begun)
                grant = self.core.grant(header, payload, revoke=lambda: begun.revoke(tid, epoch))
                begun.add(tid)
                return frame_header(MsgType.ACCEPT, tid, epoch, grant), grant
            if kind is MsgType.BEGIN:
                self.core.on_begin(header, payload)
                begun.add(tid)
                return frame_header(MsgType.ACCEPT, tid, epoch), b""
            if kind is MsgType.FRAME and (ring is None) != bool(header.flags & FLAG_IN_PLACE):
                raise FrameError("flags", "a commit needs registered mode and vice versa")
            if kind is MsgType.FRAME and ring is None:
                self.core.on_written(header)
                return None
            if kind is MsgType.FRAME:
                assert ring is not None
                start = header.aux * slot_bytes
                if header.payload_len > slot_bytes or start + slot_bytes > ring.numel():
                    raise FrameError("aux", f"slot {header.aux} or length outside the ring")
                self.core.on_frame(header, ring[start : start + header.payload_len])
                return frame_header(MsgType.FRAME_ACK, tid, epoch, aux=header.aux), b""
            if kind is MsgType.END:
                self.core.on_end(header, payload)
                return frame_header(MsgType.DONE, tid, epoch), b""
            if kind is MsgType.CANCEL:
                with contextlib.suppress(TransferError):
                    self.core.on_cancel(header)
                return None
            raise FrameError("msg_type", f"unexpected {kind.name}")
        except TransferError as exc:
            wire = error_to_wire(exc)
            return frame_header(MsgType.ERROR, tid, epoch, wire, aux=header.aux), wire


class _Begun(set[bytes]):
    """Transfers begun on one connection, and its replies sent under one lock (a revoke may
    come from another thread)."""

    def __init__(self, conn: socket.socket) -> None:
        super().__init__()
        self._conn = conn
        self._lock = threading.Lock()

    def send(self, header: FrameHeader, payload: bytes = b"") -> None:
        with self._lock:
            send_msg(self._conn, header, payload)

    def revoke(self, tid: bytes, epoch: int) -> None:
        """The reservation ended early: tell the sender to stop writing into its window."""
        with contextlib.suppress(TransferError):
            self.send(frame_header(MsgType.CANCEL, tid, epoch))


class _Attached:
    """A peer's segment mapped without registering it with this process's resource tracker
    (the creator owns the name and unlinks it)."""

    def __init__(self, name: str) -> None:
        if not name.startswith(SEGMENT_PREFIX) or "/" in name:
            raise FrameError("segment", f"unexpected segment name {name!r}")
        try:
            fd = _posixshmem.shm_open("/" + name, os.O_RDWR, mode=0o600)
        except OSError as exc:
            raise PeerError(f"cannot attach segment: {exc}") from None
        try:
            self._mmap = mmap.mmap(fd, os.fstat(fd).st_size)
        finally:
            os.close(fd)
        self.buf = memoryview(self._mmap)

    def close(self) -> None:
        self.buf.release()
        self._mmap.close()


class Sender(KVSender):
    """`mode`: "registered" (one copy into the receiver's cache; fails unless it is shared),
    "staging" (slots), or "auto" (registered when the receiver offers it, else staging).
    `frame_bytes`: the staging slot size, and in registered mode how many bytes one commit
    covers (default 16 MiB there: a commit moves no bytes, fewer wake the receiver less)."""

    def __init__(
        self,
        store: BlockStore,
        address: str,
        *,
        frame_bytes: int | None = None,
        slots: int = 4,
        checksum: bool = CHECKSUM_DEFAULT,
        mode: str = "auto",
    ) -> None:
        super().__init__(store, frame_bytes or DEFAULT_FRAME_BYTES)
        self._commit_bytes = frame_bytes or COMMIT_BYTES
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
        self._slot_bytes = self.max_frame_bytes
        self._close_lock = threading.Lock()  # close() runs on the caller's and transfer threads
        self._connect(time.monotonic() + HANDSHAKE_SECONDS)

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
            theirs, extras = _split_hello(payload)
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

    def _hello(self, extras: dict[str, object]) -> bytes:
        return self.layout.to_bytes() + b"\0" + json.dumps(extras).encode()

    def _map_window(self, conn: socket.socket, extras: dict[str, object]) -> torch.Tensor:
        """The receiver's registered cache, mapped here: uint8 [bytes]."""
        return _map_region(conn, extras)

    def close(self) -> None:
        """Idempotent and safe from two threads at once (a transfer aborting on its deadline
        while the owner closes): each resource is taken under the lock, closed once."""
        with self._close_lock:
            conn, segment = self._conn, self._segment
            self._conn = self._segment = self._ring = self._window = None
        if conn is not None:
            conn.close()
        if segment is not None:
            # A transfer thread still inside _run holds a view of the ring; the segment is then
            # unmapped by SharedMemory's finalizer when that view goes (its name is unlinked).
            with contextlib.suppress(BufferError):
                segment.close()

    def _transfer(self, plan: SendPlan, record: TransferRecord, waiter: Waiter) -> None:
        if self._conn is None:
            self._connect(min(waiter.deadline, time.monotonic() + HANDSHAKE_SECONDS))
        try:
            if self._window is not None:
                self._run_registered(plan, waiter)
            else:
                self._run(plan, waiter)
        except BaseException as exc:
            self._abort(plan, exc)
            raise

    def _abort(self, plan: SendPlan, exc: BaseException) -> None:
        """Tell the receiver (best effort), then drop the connection: its state is unknown."""
        if self._conn is not None and isinstance(exc, TransferError):
            tid, epoch = plan.request.transfer_id, plan.request.epoch
            with contextlib.suppress(TransferError):
                send_msg(self._conn, frame_header(MsgType.CANCEL, tid, epoch))
        self.close()

    def _run_registered(self, plan: SendPlan, waiter: Waiter) -> None:
        """BEGIN → window; per frame: copy into the window, commit; END → DONE."""
        assert self._conn is not None and self._window is not None
        conn, window = self._conn, self._window
        tid, epoch = plan.request.transfer_id, plan.request.epoch
        begin = plan.begin_payload()
        send_msg(conn, frame_header(MsgType.BEGIN, tid, epoch, begin), begin)
        grant = Grant.decode(self._expect_msg(MsgType.ACCEPT, waiter)[1])
        if int(grant.kv.numel()) != int(plan.dst.numel()):
            raise FrameError("grant", f"{grant.kv.numel()} blocks for {plan.dst.numel()}")
        rows = self.store.row_views()
        flags = FLAG_IN_PLACE | (0 if self.checksum else FLAG_NO_CHECKSUM)
        for index in plan.iter_frames(waiter):
            conn.settimeout(waiter.check())  # a commit blocked on a full socket ends in time
            self._poll_refusal(tid)
            lo, n = plan.frames[index]
            digest = write_granted(rows, window, grant, plan.src[lo : lo + n], lo, self.checksum)
            self._publish(window)  # the writes are visible before their commit goes out
            header = FrameHeader(
                MsgType.FRAME, tid, epoch, index, plan.frame_count, lo, n,
                n * self.layout.bytes_per_block, checksum=digest, flags=flags,
            )  # fmt: skip
            send_msg(conn, header)
        waiter.check()  # a streamed plan stops early on cancel or expiry
        send_msg(conn, *plan.end_frame())  # the producer's trailer rides the END
        self._expect(MsgType.DONE, waiter)

    def _poll_refusal(self, tid: bytes) -> None:
        """Raise at once if the receiver refused a commit or cancelled transfer `tid` (no
        waiting; a revoke of an earlier transfer is ignored)."""
        assert self._conn is not None
        while select.select([self._conn], [], [], 0)[0]:
            header, payload = recv_msg(self._conn, time.monotonic() + HANDSHAKE_SECONDS)
            if header.msg_type is not MsgType.CANCEL or header.transfer_id == tid:
                raise _peer_reason(header, payload)

    def _run(self, plan: SendPlan, waiter: Waiter) -> None:
        assert self._conn is not None and self._ring is not None
        conn, ring, tid, epoch = (
            self._conn,
            self._ring,
            plan.request.transfer_id,
            plan.request.epoch,
        )
        begin = plan.begin_payload()
        send_msg(conn, frame_header(MsgType.BEGIN, tid, epoch, begin), begin)
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

    def _publish(self, slot: torch.Tensor) -> None:
        """Make a filled slot visible to the receiver before its FRAME header goes out."""

    def _expect(self, kind: MsgType, waiter: Waiter) -> FrameHeader:
        return self._expect_msg(kind, waiter)[0]

    def _expect_msg(self, kind: MsgType, waiter: Waiter) -> tuple[FrameHeader, bytearray]:
        """Next message must be `kind`; ERROR and CANCEL raise the peer's reason."""
        assert self._conn is not None
        while True:
            left = waiter.check()
            readable, _, _ = select.select([self._conn], [], [], min(left, 0.05))
            if not readable:  # poll slice: re-check cancel and deadline
                continue
            header, payload = recv_msg(self._conn, waiter.deadline)
            if header.msg_type is kind:
                return header, payload
            raise _peer_reason(header, payload, kind)


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
