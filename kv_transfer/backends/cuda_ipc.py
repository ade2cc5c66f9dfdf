"""Same-node GPU backend: the receiver's cache (or the sender's staging ring) shared through a
CUDA IPC handle.

The control channel is the shared-memory backend's Unix socket and protocol, in the same two
modes. **registered** (default when the receiver's cache is a CUDA tensor without scales): the
receiver's HELLO_ACK carries the IPC handle of its cache's storage; per transfer BEGIN is
answered with the write window (byte offsets of the reserved blocks), the sender gathers its
blocks straight into them (`index_select` into the mapped storage, one device copy),
synchronizes, and commits them, exactly as `shm` does into a host cache (the same sender and
receiver code). **staging**: the sender's ring is shared instead (HELLO, BEGIN, FRAME with a
slot index, FRAME_ACK, END, DONE). The receiver's address is
`unix:PATH#TOKEN`: a peer must run as our uid (SO_PEERCRED) and present TOKEN in its HELLO, or
it is refused before any handle is opened. The HELLO then carries the ring's IPC handle
(JSON, hex bytes; never pickle); the receiver opens it once per connection, copies each frame
from its slot into the reserved blocks device-to-device, synchronizes, acknowledges the slot,
and closes the handle when the connection ends. Needs CUDA on both sides (imports lazily).
"""

from __future__ import annotations

import hmac
import json
import secrets
import socket
import time
from typing import Any

import torch

from kv_transfer.backends import shm
from kv_transfer.blocks import BlockStore
from kv_transfer.control import recv_msg, send_msg, unix_path
from kv_transfer.errors import (
    AuthenticationError,
    BackendUnavailableError,
    FrameError,
    error_to_wire,
)
from kv_transfer.header import MsgType, frame_header
from kv_transfer.layout import KVLayout, split_hello

HANDSHAKE_SECONDS = 10.0
_HANDLE_FIELDS = (  # torch.UntypedStorage._share_cuda_() order
    ("device", int),
    ("handle", bytes),
    ("size_bytes", int),
    ("offset_bytes", int),
    ("ref_counter_handle", bytes),
    ("ref_counter_offset", int),
    ("event_handle", bytes),
    ("event_sync_required", bool),
)


def _require_cuda(store: BlockStore) -> None:
    if not torch.cuda.is_available():
        raise BackendUnavailableError("cuda_ipc needs CUDA; none is available here")
    if store.cache.device.type != "cuda":
        raise BackendUnavailableError("cuda_ipc needs a CUDA cache")


def encode_handle(fields: tuple[Any, ...]) -> dict[str, Any]:
    """`_share_cuda_()` output as plain JSON values (bytes as hex)."""
    if len(fields) != len(_HANDLE_FIELDS):
        raise FrameError("handle", f"expected {len(_HANDLE_FIELDS)} fields, got {len(fields)}")
    out: dict[str, Any] = {}
    for (name, kind), value in zip(_HANDLE_FIELDS, fields, strict=True):
        out[name] = value.hex() if kind is bytes else kind(value)
    return out


def decode_handle(raw: object) -> tuple[Any, ...]:
    """Inverse of `encode_handle`; every defect raises `FrameError` naming the field."""
    if not isinstance(raw, dict):
        raise FrameError("handle", "not an object")
    values: list[Any] = []
    for name, kind in _HANDLE_FIELDS:
        value = raw.get(name)
        if kind is bytes:
            if not isinstance(value, str):
                raise FrameError(name, "must be hex")
            try:
                values.append(bytes.fromhex(value))
            except ValueError:
                raise FrameError(name, "must be hex") from None
        elif type(value) is not kind:
            raise FrameError(name, f"must be {kind.__name__}")
        else:
            values.append(value)
    return tuple(values)


def split_address(address: str) -> tuple[str, str]:
    """`unix:PATH#TOKEN` → (`unix:PATH`, TOKEN)."""
    base, sep, token = address.partition("#")
    if not sep or not token:
        raise FrameError("address", "expected unix:PATH#TOKEN")
    unix_path(base)
    return base, token


def hello_payload(layout: KVLayout, token: str, extras: dict[str, Any]) -> bytes:
    return layout.to_bytes() + b"\0" + json.dumps({**extras, "token": token}).encode()


def authenticate(conn: socket.socket, token: str, deadline: float) -> tuple[KVLayout, dict]:
    """Read HELLO; refuse (ERROR auth, then `AuthenticationError`) unless it carries `token`.
    The peer's uid was already checked by the Unix server (SO_PEERCRED)."""
    header, payload = recv_msg(conn, deadline)
    if header.msg_type is not MsgType.HELLO:
        raise FrameError("msg_type", f"expected HELLO, got {header.msg_type.name}")
    layout, extras = split_hello(payload)
    offered = extras.get("token")
    if not isinstance(offered, str) or not hmac.compare_digest(offered, token):
        error = AuthenticationError("wrong or missing token")
        wire = error_to_wire(error)
        send_msg(conn, frame_header(MsgType.ERROR, bytes(16), 0, wire), wire)
        raise error
    return layout, extras


class Receiver(shm.Receiver):
    def __init__(self, store: BlockStore, *, require_cuda: bool = True) -> None:
        if require_cuda:
            _require_cuda(store)
        self._token = secrets.token_hex(16)
        super().__init__(store)

    @property
    def address(self) -> str:
        return f"{self._server.address}#{self._token}"

    def _read_hello(self, conn: socket.socket) -> tuple[KVLayout, dict[str, object]]:
        return authenticate(conn, self._token, time.monotonic() + HANDSHAKE_SECONDS)

    def _serve_staging(
        self, conn: socket.socket, ours: bytes, extras: dict[str, object], slot_bytes: int
    ) -> None:
        """Open the sender's device ring from its IPC handle; copy each frame out of its slot."""
        ack = frame_header(MsgType.HELLO_ACK, bytes(16), 0, ours)
        _require_cuda(self.store)
        storage = torch.UntypedStorage._new_shared_cuda(*decode_handle(extras.get("handle")))
        ring = torch.empty(0, dtype=torch.uint8, device=storage.device)
        ring.set_(storage)  # [slots * slot_bytes] on the sender's ring, mapped here
        send_msg(conn, ack, ours)
        try:
            self._loop(conn, ring, slot_bytes)
        finally:
            torch.cuda.synchronize(ring.device)
            del ring, storage  # closes the IPC mapping
            torch.cuda.ipc_collect()

    def _registration(self) -> tuple[dict[str, object], list[int]]:
        """The IPC handle of the cache's storage (a CUDA cache without scales)."""
        if not self.store.device_window:
            raise BackendUnavailableError("registered cuda_ipc needs a CUDA cache without scales")
        storage = self.store.cache.untyped_storage()
        return {"handle": encode_handle(storage._share_cuda_()), "bytes": storage.nbytes()}, []

    def _dispatch(self, header, payload, ring, slot_bytes, begun):  # type: ignore[no-untyped-def]
        reply = super()._dispatch(header, payload, ring, slot_bytes, begun)
        if header.msg_type is MsgType.FRAME and ring is not None:
            torch.cuda.synchronize(ring.device)  # the copy out of the slot is done: ack frees it
        return reply


class Sender(shm.Sender):
    def __init__(
        self,
        store: BlockStore,
        address: str,
        *,
        frame_bytes: int | None = None,
        slots: int = 4,
        mode: str = "auto",
        connect_deadline: float | None = None,
    ) -> None:
        _require_cuda(store)
        base, self._token = split_address(address)
        self._ring_storage: torch.Tensor | None = None
        super().__init__(
            store,
            base,
            frame_bytes=frame_bytes,
            slots=slots,
            checksum=False,
            mode=mode,
            connect_deadline=connect_deadline,
        )

    def _hello(self, extras: dict[str, object]) -> bytes:
        return hello_payload(self.layout, self._token, extras)

    def _map_window(self, conn: socket.socket, extras: dict[str, object]) -> torch.Tensor:
        """Open the receiver's cache storage from its IPC handle: uint8 [bytes] on its GPU."""
        storage = torch.UntypedStorage._new_shared_cuda(*decode_handle(extras.get("handle")))
        window = torch.empty(0, dtype=torch.uint8, device=storage.device)
        return window.set_(storage)

    def _connect_staging(self, deadline: float) -> None:
        device = self.store.cache.device
        ring = torch.empty(self._slots * self._slot_bytes, dtype=torch.uint8, device=device)
        handle = encode_handle(ring.untyped_storage()._share_cuda_())
        hello = self._hello({"slot_bytes": self._slot_bytes, "handle": handle})
        conn, _ = self._handshake(hello, deadline, peer_refusal=True)
        self._conn, self._ring = conn, ring

    def _publish(self, slot: torch.Tensor) -> None:
        torch.cuda.synchronize(slot.device)  # the copy into the slot or window has landed
        if slot.device != self.store.cache.device:
            torch.cuda.synchronize(self.store.cache.device)

    def _landed(self, window: torch.Tensor) -> None:
        """A piece's device copy lands before the write lock is let go: a sender stopped
        (cancelled, closed) leaves no copy queued behind it."""
        torch.cuda.synchronize(window.device)
