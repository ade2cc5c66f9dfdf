"""The `shm` backend's receiver: one thread per Unix-socket connection, in registered mode
(grants and commits into this cache's shared region) or staging mode (scatter from the
sender's slot ring); see `kv_transfer.backends.shm` for the protocol."""

from __future__ import annotations

import _posixshmem
import contextlib
import json
import mmap
import os
import socket
import threading
import time

import torch

from kv_transfer.blocks import BlockStore
from kv_transfer.control import recv_msg, send_msg
from kv_transfer.errors import (
    BackendUnavailableError,
    DeadlineExpiredError,
    FrameError,
    PeerError,
    TransferError,
    error_to_wire,
)
from kv_transfer.header import FLAG_IN_PLACE, FrameHeader, MsgType, frame_header
from kv_transfer.interface import KVReceiver
from kv_transfer.layout import KVLayout, split_hello
from kv_transfer.unix_server import UnixServer

HANDSHAKE_SECONDS = 10.0
IDLE_SECONDS = 600.0  # an idle connection is closed; the sender reconnects on its next send
REPLY_SECONDS = HANDSHAKE_SECONDS  # a reply the sender does not take by then cuts its connection
SEGMENT_PREFIX = "kvmesh_"


class Receiver(KVReceiver):
    def __init__(self, store: BlockStore) -> None:
        super().__init__(store)
        self._server = UnixServer(self._serve, "kv-shm")

    @property
    def address(self) -> str:
        return self._server.address

    def close(self) -> None:
        self._server.close()

    def _read_hello(self, conn: socket.socket) -> tuple[KVLayout, dict[str, object]]:
        header, payload = recv_msg(conn, time.monotonic() + HANDSHAKE_SECONDS)
        if header.msg_type is not MsgType.HELLO:
            raise FrameError("msg_type", f"expected HELLO, got {header.msg_type.name}")
        return split_hello(payload)

    def _serve(self, conn: socket.socket) -> None:
        theirs, extras = self._read_hello(conn)
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
        self._serve_staging(conn, ours, extras, slot_bytes)

    def _serve_staging(
        self, conn: socket.socket, ours: bytes, extras: dict[str, object], slot_bytes: int
    ) -> None:
        """Attach the sender's ring, then scatter each frame from its slot."""
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
                ends = header.msg_type in (MsgType.END, MsgType.CANCEL)
                if ends and begun.end(header.transfer_id, header.epoch):  # no write follows
                    self.core.window_closed(header.transfer_id, header.epoch)
                if reply is not None and can_reply:
                    try:
                        begun.send(*reply)
                    except PeerError:
                        can_reply = False
        except TransferError as exc:
            self.core.fail_ids(begun.snapshot(), PeerError(f"sender connection lost: {exc}"))
            raise
        finally:  # the sender closed its connection: so ended its writes under what it began
            if not begun.close():  # unless this side cut it (those close at lease plus grace)
                for tid, epoch in begun.snapshot():
                    self.core.window_closed(tid, epoch)

    def _dispatch(
        self,
        header: FrameHeader,
        payload: bytearray,
        ring: torch.Tensor | None,
        slot_bytes: int,
        begun: _Begun,
    ) -> tuple[FrameHeader, bytes] | None:
        tid, epoch, kind = header.transfer_id, header.epoch, header.msg_type
        try:
            if kind is MsgType.BEGIN and ring is None:
                grant = self.core.grant(header, payload, revoke=lambda: begun.revoke(tid, epoch))
                begun.add(tid, epoch)
                return frame_header(MsgType.ACCEPT, tid, epoch, grant), grant
            if kind is MsgType.BEGIN:
                self.core.on_begin(header, payload)
                begun.add(tid, epoch)
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


class _Begun:
    """The transfers, `(transfer id, epoch)`, begun on one connection and not yet ended on it
    by their END or CANCEL, and the connection's replies, sent under one lock (a revoke comes
    from another thread: a cancel on the decode side's event loop, which must never wait)."""

    def __init__(self, conn: socket.socket) -> None:
        self._conn = conn
        self._keys: set[tuple[bytes, int]] = set()  # changed by the connection's thread only
        self._lock = threading.Lock()
        self._cut = False  # this side shut the connection down: its sender may still write
        self._closed = False  # the connection's thread is done with it (it closes next)

    def add(self, tid: bytes, epoch: int) -> None:
        self._keys.add((tid, epoch))

    def end(self, tid: bytes, epoch: int) -> bool:
        """The sender ended `tid` under `epoch` here (END or CANCEL); whether it began it here."""
        if (tid, epoch) not in self._keys:
            return False
        self._keys.discard((tid, epoch))
        return True

    def snapshot(self) -> list[tuple[bytes, int]]:
        return list(self._keys)

    def __len__(self) -> int:
        return len(self._keys)

    def send(self, header: FrameHeader, payload: bytes = b"") -> None:
        """Reply; a sender that does not take it within REPLY_SECONDS (it stopped reading) has
        its connection cut; PeerError when the reply did not go out."""
        with self._lock:
            try:
                self._conn.settimeout(REPLY_SECONDS)
                send_msg(self._conn, header, payload)
            except DeadlineExpiredError:
                self._shut()
                raise PeerError("the sender did not take a reply in time") from None
            except OSError as exc:
                raise PeerError(f"send failed: {exc}") from None

    def revoke(self, tid: bytes, epoch: int) -> None:
        """The reservation ended early: tell the sender to stop writing into its window, never
        waiting. When the CANCEL cannot go out whole at once (a reply is being sent, or the
        sender does not read), the connection is cut instead: its thread fails what it began,
        and the window stays open until the lease plus the grace (the sender may be mid-copy)."""
        if (tid, epoch) not in self._keys:  # ended here already: the sender stopped writing
            return
        if not self._lock.acquire(blocking=False):
            self._shut()
            return
        try:
            cancel = frame_header(MsgType.CANCEL, tid, epoch)
            if not self._closed and not _send_now(self._conn, cancel):
                self._shut()
        finally:
            self._lock.release()

    def _shut(self) -> None:
        self._cut = True
        with contextlib.suppress(OSError):
            self._conn.shutdown(socket.SHUT_RDWR)

    def close(self) -> bool:
        """The connection's thread is done (no revoke writes to it any more); whether this side
        cut it."""
        with self._lock:
            self._closed = True
            return self._cut


def _send_now(conn: socket.socket, header: FrameHeader) -> bool:
    """Write a payload-less message without waiting (the descriptor is non-blocking once the
    socket has a timeout, which every read set): False when it did not go out whole at once
    (the sender is not reading). A broken connection counts as sent: its thread finds it so."""
    data = header.encode()
    try:
        fd = conn.fileno()
        return not os.get_blocking(fd) and os.write(fd, data) == len(data)
    except BlockingIOError:
        return False
    except OSError:
        return True


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
