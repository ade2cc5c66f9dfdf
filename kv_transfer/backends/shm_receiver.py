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
                if ends and header.transfer_id in begun:  # granted here: no write follows
                    self.core.window_closed(header.transfer_id, header.epoch)
                if reply is not None and can_reply:
                    try:
                        begun.send(*reply)
                    except PeerError:
                        can_reply = False
        except TransferError as exc:
            self.core.fail_ids(begun, PeerError(f"sender connection lost: {exc}"))
            raise
        finally:  # the sender's connection is gone: so are its writes
            for tid in list(begun):
                self.core.window_closed(tid)

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
