"""Same-host CPU backend: a shared-memory ring of staging slots plus a Unix-socket control channel.

The sender creates one segment per connection (`slots` x `slot_bytes`, random name), sends its
name in HELLO, and unlinks it as soon as the receiver has attached (HELLO_ACK): after the
handshake no name exists, so no process death can leak it. Per frame the sender gathers blocks
into a free slot and sends a FRAME header (aux = slot); the receiver scatters from the slot into
the reserved blocks and answers FRAME_ACK, which frees the slot.
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
    FrameError,
    PeerError,
    TransferCancelledError,
    TransferError,
    error_to_wire,
    parse_wire_error,
)
from kv_transfer.header import FLAG_IN_SLOT, FrameHeader, MsgType, frame_header
from kv_transfer.interface import (
    DEFAULT_FRAME_BYTES,
    KVReceiver,
    KVSender,
    SendPlan,
    Waiter,
    fill_frame,
)
from kv_transfer.layout import KVLayout
from kv_transfer.state import TransferRecord
from kv_transfer.unix_server import UnixServer

HANDSHAKE_SECONDS = 10.0
IDLE_SECONDS = 600.0  # an idle connection is closed; the sender reconnects on its next send
SEGMENT_PREFIX = "kvmesh_"


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
        ack = frame_header(MsgType.HELLO_ACK, bytes(16), 0, ours)
        if theirs != self.layout:  # the sender raises the mismatch from our layout
            send_msg(conn, ack, ours)
            self.layout.check_compatible(theirs)
        slot_bytes = extras.get("slot_bytes")
        if not isinstance(slot_bytes, int) or slot_bytes <= 0:
            raise FrameError("slot_bytes", f"must be a positive int, got {slot_bytes!r}")
        segment = _Attached(str(extras.get("segment", "")))
        send_msg(conn, ack, ours)  # attached: the sender may now unlink the name
        ring = torch.frombuffer(segment.buf, dtype=torch.uint8)  # [slots * slot_bytes]
        try:
            self._loop(conn, ring, slot_bytes)
        finally:
            del ring  # the tensor must not outlive the mapping
            segment.close()

    def _loop(self, conn: socket.socket, ring: torch.Tensor, slot_bytes: int) -> None:
        begun: set[bytes] = set()
        can_reply = True  # after a failed reply keep reading: a CANCEL may still be buffered
        try:
            while True:
                header, payload = recv_msg(conn, time.monotonic() + IDLE_SECONDS)
                reply = self._dispatch(header, payload, ring, slot_bytes, begun)
                if reply is not None and can_reply:
                    try:
                        send_msg(conn, *reply)
                    except PeerError:
                        can_reply = False
        except TransferError as exc:
            self.core.fail_ids(begun, PeerError(f"sender connection lost: {exc}"))
            raise

    def _dispatch(
        self,
        header: FrameHeader,
        payload: bytearray,
        ring: torch.Tensor,
        slot_bytes: int,
        begun: set[bytes],
    ) -> tuple[FrameHeader, bytes] | None:
        tid, epoch, kind = header.transfer_id, header.epoch, header.msg_type
        try:
            if kind is MsgType.BEGIN:
                self.core.on_begin(header, payload)
                begun.add(tid)
                return frame_header(MsgType.ACCEPT, tid, epoch), b""
            if kind is MsgType.FRAME:
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
    def __init__(
        self,
        store: BlockStore,
        address: str,
        *,
        frame_bytes: int = DEFAULT_FRAME_BYTES,
        slots: int = 4,
        checksum: bool = True,
    ) -> None:
        super().__init__(store, frame_bytes)
        self._path = unix_path(address)
        self._slots = slots
        self.checksum = checksum
        self._slot_bytes = self.max_frame_bytes
        self._conn: socket.socket | None = None
        self._segment: shared_memory.SharedMemory | None = None
        self._ring: torch.Tensor | None = None
        self._close_lock = threading.Lock()  # close() runs on the caller's and transfer threads
        self._connect(time.monotonic() + HANDSHAKE_SECONDS)

    def _handshake(
        self, hello: bytes, deadline: float, *, peer_refusal: bool = False
    ) -> socket.socket:
        """Connect to the receiver, send `hello` and wait for a HELLO_ACK whose layout is
        compatible with ours; the connection is closed on any failure. With `peer_refusal`, an
        ERROR reply raises the receiver's own error."""
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
            self.layout.check_compatible(KVLayout.from_bytes(bytes(payload)))
        except OSError as exc:
            conn.close()
            raise PeerError(f"cannot connect to {self._path}: {exc}") from None
        except BaseException:
            conn.close()
            raise
        return conn

    def _connect(self, deadline: float) -> None:
        name = f"{SEGMENT_PREFIX}{os.urandom(8).hex()}"
        segment = shared_memory.SharedMemory(name, create=True, size=self._slots * self._slot_bytes)
        try:
            extras = json.dumps({"segment": name, "slot_bytes": self._slot_bytes}).encode()
            hello = self.layout.to_bytes() + b"\0" + extras
            conn = self._handshake(hello, deadline)
        finally:
            segment.unlink()  # attached by the peer (or refused): the name is no longer needed
        self._conn, self._segment = conn, segment
        self._ring = torch.frombuffer(segment.buf, dtype=torch.uint8)  # [slots * slot_bytes]

    def close(self) -> None:
        """Idempotent and safe from two threads at once (a transfer aborting on its deadline
        while the owner closes): each resource is taken under the lock, closed once."""
        with self._close_lock:
            conn, segment = self._conn, self._segment
            self._conn = self._segment = self._ring = None
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
        """Next message must be `kind`; ERROR and CANCEL raise the peer's reason."""
        assert self._conn is not None
        while True:
            left = waiter.check()
            readable, _, _ = select.select([self._conn], [], [], min(left, 0.05))
            if not readable:  # poll slice: re-check cancel and deadline
                continue
            header, payload = recv_msg(self._conn, waiter.deadline)
            if header.msg_type is kind:
                return header
            if header.msg_type is MsgType.ERROR:
                raise parse_wire_error(bytes(payload))
            if header.msg_type is MsgType.CANCEL:
                raise TransferCancelledError("cancelled by the receiver")
            raise PeerError(f"expected {kind.name}, got {header.msg_type.name}")
