"""`torch.distributed` point-to-point backend: gloo for CPU caches, NCCL for CUDA caches.

Rendezvous: the receiver serves a `TCPStore` on its advertised `host:port`. A sender pushes a
HELLO (layout + largest frame) under a random link id; the receiver answers with its layout or
a refusal, and both build a two-rank process group (receiver rank 0, sender rank 1) over a
`PrefixStore` of that link. Groups are expensive, so a link is pooled per peer and reused by
every later transfer; a link whose wait failed or timed out is aborted and rebuilt on the next
transfer.

Messages on a link (in order): header `[80]` uint8, then payload `[payload_len]` uint8 when
`payload_len > 0` (never unpickled). Sender → receiver: BEGIN (destination ids), FRAME, END,
CANCEL. Receiver → sender: ACCEPT, FRAME_ACK, DONE, ERROR (`code\\0message`). One frame is in
flight: the sender prepares frame k+1 while frame k travels, then waits for k's FRAME_ACK.
Every wait has a timeout (the transfer deadline, or the idle limit of a link).

A frame whose source blocks are one run of the cache (`BlockStore.run_view`: consecutive
block ids of a host cache without scales are one byte range) is sent from the cache itself;
others are gathered into one of two staging buffers. The receiver always reads a payload into
its link's staging buffer, then checks and scatters it: reading straight into the reserved
blocks would leave them exposed to a late write whenever a receive fails half-way (a peer
stopped mid-frame) and the blocks go back to the pool before the transport is certainly
silent, which this module cannot prove for gloo's transport threads.

Where the time goes (2-core machine, 128 MiB, host cache): per byte, gloo's TCP loop threads
(epoll wake-ups and socket copies) cost more than the copies around them, and each frame
costs a round trip (FRAME_ACK). 16 MiB frames (`FRAME_BYTES`) took about 0.6x the CPU of
2 MiB frames for the same bytes.
"""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
from typing import Any

import torch

from kv_transfer.backends.gloo_link import (
    HANDSHAKE_SECONDS,
    IDLE_SECONDS,
    POOL,
    QUEUE,
    RECEIVER_RANK,
    SENDER_RANK,
    Link,
    new_group,
    split_host_port,
    td,
)
from kv_transfer.blocks import BlockStore
from kv_transfer.control import MAX_CONTROL_PAYLOAD
from kv_transfer.errors import (
    FrameError,
    PeerError,
    TransferError,
    error_to_wire,
    parse_wire_error,
)
from kv_transfer.header import FrameHeader, MsgType, frame_header
from kv_transfer.interface import (
    KVReceiver,
    KVSender,
    SendPlan,
    Waiter,
    fill_frame,
    payload_header,
)
from kv_transfer.layout import split_hello
from kv_transfer.state import TransferRecord

if not torch.distributed.is_available():  # pragma: no cover - builds without distributed
    raise ImportError("torch.distributed is not available in this torch build")

import torch.distributed as dist

REPLY_SECONDS = 10.0  # receiver's bound on delivering one reply
MAX_FRAME_BYTES = 256 << 20
FRAME_BYTES = 16 << 20  # measured: 16 MiB frames took 0.6x the CPU of 2 MiB ones per byte
_CLOSE = "!close"


def _control_payload(header: FrameHeader, link: Link, deadline: float) -> bytes:
    if header.payload_len > MAX_CONTROL_PAYLOAD:
        raise FrameError("payload_len", f"{header.payload_len} above {MAX_CONTROL_PAYLOAD}")
    if not header.payload_len:
        return b""
    buf = torch.empty(header.payload_len, dtype=torch.uint8, device=link.device)
    data = link.recv_payload(buf, deadline).cpu().numpy().tobytes()
    header.verify_payload(data)
    return data


class Receiver(KVReceiver):
    """Serves a TCPStore at `bind` (`HOST:PORT`, port 0 picks one) and one thread per link."""

    def __init__(
        self, store: BlockStore, *, bind: str = "127.0.0.1:0", advertise: str | None = None
    ) -> None:
        super().__init__(store)
        host, port = split_host_port(bind)
        self._host = advertise or (host if host not in ("0.0.0.0", "::") else socket.getfqdn())
        self._device = store.cache.device
        try:
            self._store: Any = dist.TCPStore(
                host, port, None, True, td(HANDSHAKE_SECONDS), wait_for_workers=False
            )
        except Exception as exc:
            raise OSError(f"gloo receiver could not bind {bind}: {exc}") from None
        self._port = int(self._store.port)
        self._links: set[Link] = set()  # guarded by _lock
        self._lock = threading.Lock()
        self._closed = False
        self._accepter = threading.Thread(target=self._accept_loop, name="kv-gloo-accept")
        self._accepter.daemon = True
        self._accepter.start()

    @property
    def address(self) -> str:
        return f"[{self._host}]:{self._port}" if ":" in self._host else f"{self._host}:{self._port}"

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(Exception):
            self._store.queue_push(QUEUE, _CLOSE)
        self._accepter.join(5)
        with self._lock:
            links = list(self._links)
        for link in links:
            link.abort()
        self._store = None  # the last reference stops the store's server

    def _accept_loop(self) -> None:
        waiter = self._store.clone()
        waiter.set_timeout(td(60.0))
        while not self._closed:
            try:
                link_id = waiter.queue_pop(QUEUE).decode()
            except Exception:  # idle poll timed out: look at `_closed` again
                continue
            if link_id == _CLOSE or self._closed:
                return
            thread = threading.Thread(target=self._serve, args=(link_id,), name="kv-gloo-link")
            thread.daemon = True
            thread.start()

    def _serve(self, link_id: str) -> None:
        scope = f"kvmesh/link/{link_id}/"
        try:
            theirs, extras = split_hello(self._store.get(scope + "hello"))
            ours = self.layout.to_bytes()
            max_frame = extras.get("max_frame")
            ack: dict[str, str] = {"layout": ours.decode()}
            try:  # the sender raises a layout mismatch itself, from our layout
                self.layout.check_compatible(theirs)
                if not isinstance(max_frame, int) or not 0 < max_frame <= MAX_FRAME_BYTES:
                    raise FrameError("max_frame", f"must be in (0, {MAX_FRAME_BYTES}]")
            except TransferError as exc:
                ack["error"] = error_to_wire(exc).decode()
            self._store.set(scope + "ack", json.dumps(ack))
            if "error" in ack or not isinstance(max_frame, int):
                return
            group = new_group(
                torch.distributed.PrefixStore(scope, self._store), RECEIVER_RANK, self._device,
                self._host,
            )  # fmt: skip
            for key in ("hello", "ack"):
                self._store.delete_key(scope + key)
        except Exception:  # a half-open handshake: the sender times out and gives up
            return
        link = Link(group, SENDER_RANK, self._device, max_frame)
        with self._lock:
            self._links.add(link)
        try:
            self._loop(link)
        finally:
            link.abort()
            with self._lock:
                self._links.discard(link)

    def _loop(self, link: Link) -> None:
        begun: set[bytes] = set()
        staging = torch.empty(link.max_frame, dtype=torch.uint8, device=link.device)
        try:
            while not self._closed:
                header = link.recv_header(time.monotonic() + IDLE_SECONDS)
                reply = self._handle(link, header, staging, begun)
                if reply is not None:
                    link.send(*reply, deadline=time.monotonic() + REPLY_SECONDS)
        except TransferError as exc:
            self.core.fail_ids(begun, PeerError(f"sender link lost: {exc}"))

    def _handle(
        self, link: Link, header: FrameHeader, staging: torch.Tensor, begun: set[bytes]
    ) -> tuple[FrameHeader, torch.Tensor | None] | None:
        """Read the message's payload (keeps the stream in step), then apply it to the core."""
        deadline = time.monotonic() + REPLY_SECONDS
        kind, tid, epoch = header.msg_type, header.transfer_id, header.epoch
        data, payload = b"", staging[:0]
        if kind is MsgType.FRAME:
            if header.payload_len > link.max_frame:  # cannot skip it: the link is out of step
                raise FrameError("payload_len", f"{header.payload_len} above {link.max_frame}")
            payload = link.recv_payload(staging[: header.payload_len], deadline)
        else:
            data = _control_payload(header, link, deadline)
        try:
            if kind is MsgType.BEGIN:
                self.core.on_begin(header, data)
                begun.add(tid)
                return frame_header(MsgType.ACCEPT, tid, epoch), None
            if kind is MsgType.FRAME:
                self.core.on_frame(header, payload)
                return frame_header(MsgType.FRAME_ACK, tid, epoch), None
            if kind is MsgType.END:
                begun.discard(tid)
                self.core.on_end(header, data)
                return frame_header(MsgType.DONE, tid, epoch), None
            if kind is MsgType.CANCEL:
                begun.discard(tid)
                with contextlib.suppress(TransferError):
                    self.core.on_cancel(header)
                return None
            raise FrameError("msg_type", f"unexpected {kind.name}")
        except TransferError as exc:
            wire = error_to_wire(exc)
            body = torch.frombuffer(bytearray(wire), dtype=torch.uint8).to(link.device)
            return frame_header(MsgType.ERROR, tid, epoch, wire), body


class Sender(KVSender):
    def __init__(
        self,
        store: BlockStore,
        address: str,
        *,
        frame_bytes: int = FRAME_BYTES,
        checksum: bool | None = None,
    ) -> None:
        super().__init__(store, frame_bytes)
        self.address = address
        self.device = store.cache.device
        # Host payloads may cross hosts: always hashed. Device (NCCL) payloads are not hashed.
        if checksum is False and self.device.type == "cpu":
            raise FrameError("checksum", "payload checksums are always on for host tensors")
        self.checksum = self.device.type == "cpu" if checksum is None else checksum
        self._max_frame = self.max_frame_bytes
        self._staging: list[torch.Tensor] = []  # 2 x uint8 [max_frame], made on first gather
        self._close_lock = threading.Lock()
        self._link: Link | None = POOL.take(address, self.layout, self.device, self._max_frame)

    def close(self) -> None:
        """Idempotent and thread-safe. The link goes back to the pool only when no transfer of
        this sender is still running on it; otherwise its state is unknown and it is aborted."""
        with self._close_lock:
            link, self._link = self._link, None
        if link is None:
            return
        if self._active:
            link.abort()
        else:
            POOL.give(self.address, self.layout, link)

    def _transfer(self, plan: SendPlan, record: TransferRecord, waiter: Waiter) -> None:
        link = self._link
        if link is None or link.broken or time.monotonic() - link.last_used > IDLE_SECONDS / 2:
            if link is not None:
                link.abort()
            self._link = None
            link = self._link = POOL.take(self.address, self.layout, self.device, self._max_frame)
        try:
            self._run(link, plan, waiter)
        except TransferError:
            if link.broken:
                link.abort()
                self._link = None
            raise

    def _run(self, link: Link, plan: SendPlan, waiter: Waiter) -> None:
        tid, epoch = plan.request.transfer_id, plan.request.epoch
        begin = plan.begin_payload()
        body = torch.frombuffer(bytearray(begin), dtype=torch.uint8).to(self.device)
        self._exchange(link, frame_header(MsgType.BEGIN, tid, epoch, begin), body, waiter)
        pending: list[Any] | None = None
        for index in plan.iter_frames(waiter):
            header, payload = self._frame(plan, index)  # while the previous frame travels
            if pending is not None:
                self._reply(link, pending, MsgType.FRAME_ACK, waiter)
            self._check_or_cancel(link, plan, waiter)
            pending = [*link.post(header, payload), link.post_recv_header()]
        if pending is not None:
            self._reply(link, pending, MsgType.FRAME_ACK, waiter)
        self._check_or_cancel(link, plan, waiter)
        end, trailer = plan.end_frame()
        tail = None
        if trailer:
            tail = torch.frombuffer(bytearray(trailer), dtype=torch.uint8).to(self.device)
        self._exchange(link, end, tail, waiter, MsgType.DONE)

    def _frame(self, plan: SendPlan, index: int) -> tuple[FrameHeader, torch.Tensor]:
        """Frame `index`'s header and payload: the cache's own bytes when its blocks are one
        run (`run_view`), else gathered into one of two staging buffers in turn."""
        offset, n = plan.frames[index]
        payload = self.store.run_view(plan.src[offset : offset + n])
        if payload is not None:
            return payload_header(plan, index, payload, self.checksum), payload
        if not self._staging:
            self._staging = [
                torch.empty(self._max_frame, dtype=torch.uint8, device=self.device)
                for _ in range(2)
            ]
        buf = self._staging[index % 2]
        return fill_frame(self.store, plan, index, buf, self.checksum)

    def _check_or_cancel(self, link: Link, plan: SendPlan, waiter: Waiter) -> None:
        """Between frames (nothing in flight): on cancel or expiry tell the receiver, then raise."""
        try:
            waiter.check()
        except TransferError:
            tid, epoch = plan.request.transfer_id, plan.request.epoch
            with contextlib.suppress(TransferError):
                link.send(frame_header(MsgType.CANCEL, tid, epoch), None, _grace())
            raise

    def _exchange(
        self,
        link: Link,
        header: FrameHeader,
        body: torch.Tensor | None,
        waiter: Waiter,
        want: MsgType = MsgType.ACCEPT,
    ) -> None:
        self._reply(link, [*link.post(header, body), link.post_recv_header()], want, waiter)

    def _reply(self, link: Link, works: list[Any], want: MsgType, waiter: Waiter) -> None:
        """Finish the sends and the reply receive of one message; ERROR raises the peer's."""
        *sends, reply = works
        link.finish(sends, waiter.deadline)
        header = link.finish_recv_header(reply, waiter.deadline)
        if header.msg_type is MsgType.ERROR:
            raise parse_wire_error(_control_payload(header, link, waiter.deadline))
        if header.msg_type is not want:
            link.broken = True
            raise PeerError(f"expected {want.name}, got {header.msg_type.name}")


def _grace() -> float:
    return time.monotonic() + 1.0
