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

Payloads move without staging where the cache allows (`BlockStore.run_view`: consecutive
block ids of a host cache without scales are one byte range): a frame whose source blocks are
one run is sent from the cache itself, and one whose reserved blocks are one run is received
straight into them (`ReceiverCore.on_frame_into`: fencing and the frame's fields checked
first, the checksum verified in place after; a failed receive aborts the link before the
blocks are released). Such a receive holds the reservation's lock, so a payload must follow
its header at 16 MB/s or faster (`payload_seconds`): a cancel waits at most that long. Other
frames go through a staging buffer (two per sender, one per link on the receiver, made on
first use).

Where the time goes (2-core machine, 128 MiB, host cache): per byte, gloo's TCP loop threads
(epoll wake-ups and socket copies) cost more than the copies around them, and each frame
costs a round trip (FRAME_ACK). 16 MiB frames (`FRAME_BYTES`) took about 0.6x the CPU of
2 MiB frames for the same bytes.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import json
import os
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from kv_transfer.blocks import BlockStore
from kv_transfer.control import MAX_CONTROL_PAYLOAD
from kv_transfer.errors import (
    DeadlineExpiredError,
    FrameError,
    PeerError,
    TransferError,
    error_to_wire,
    parse_wire_error,
)
from kv_transfer.header import HEADER_SIZE, FrameHeader, MsgType, decode_header, frame_header
from kv_transfer.interface import (
    KVReceiver,
    KVSender,
    SendPlan,
    Waiter,
    fill_frame,
    payload_header,
)
from kv_transfer.layout import KVLayout, split_hello
from kv_transfer.state import TransferRecord

if not torch.distributed.is_available():  # pragma: no cover - builds without distributed
    raise ImportError("torch.distributed is not available in this torch build")

import torch.distributed as dist

HANDSHAKE_SECONDS = 10.0
IDLE_SECONDS = 600.0  # a receiver drops a link idle this long; senders rebuild theirs before
REPLY_SECONDS = 10.0  # receiver's bound on delivering one reply
MAX_FRAME_BYTES = 256 << 20
PAYLOAD_GRACE_SECONDS = 0.25
MIN_PAYLOAD_BYTES_PER_SECOND = 16e6  # a 16 MiB frame may take 1.3 s
FRAME_BYTES = 16 << 20  # measured: 16 MiB frames took 0.6x the CPU of 2 MiB ones per byte
_QUEUE = "kvmesh/hellos"
_CLOSE = "!close"
_RECEIVER, _SENDER = 0, 1
_POOL_PER_PEER = 4


def payload_seconds(nbytes: int) -> float:
    """How long a FRAME's payload may take once its header arrived (the sender posts both at
    once). A payload received into the reserved blocks holds the reservation's lock, so this
    bounds how long a cancel can wait for it; a slower payload aborts the link."""
    return PAYLOAD_GRACE_SECONDS + nbytes / MIN_PAYLOAD_BYTES_PER_SECOND


def _td(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=max(0.001, seconds))


def split_host_port(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or not host:
        raise FrameError("address", f"expected HOST:PORT, got {address!r}")
    return host.strip("[]"), int(port)


def _local_host_towards(host: str) -> str:
    """The local address this host uses to reach `host` (no packet is sent)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((host, 9))
            return str(probe.getsockname()[0])
    except OSError:
        return "127.0.0.1"


def _new_group(store: Any, rank: int, device: torch.device, host: str) -> Any:
    """A two-rank process group over `store`: NCCL for CUDA caches, gloo otherwise."""
    if device.type == "cuda":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = _td(HANDSHAKE_SECONDS)
        return dist.ProcessGroupNCCL(store, rank, 2, options)
    options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
    options._timeout = _td(HANDSHAKE_SECONDS)
    options._threads = 1
    return dist.ProcessGroupGloo(store, rank, 2, options)


class _Link:
    """One process group between a sender and a receiver, used by one transfer at a time."""

    def __init__(self, group: Any, peer: int, device: torch.device, max_frame: int) -> None:
        self.group = group
        self.peer = peer
        self.device = device
        self.max_frame = max_frame
        self.last_used = time.monotonic()
        self.broken = False
        self.closed = False
        self._header = torch.empty(HEADER_SIZE, dtype=torch.uint8, device=device)
        self._staging: torch.Tensor | None = None  # uint8 [max_frame], made on first use

    def staging(self, nbytes: int) -> torch.Tensor:
        """The first `nbytes` of this link's receive buffer (frames that are not one run)."""
        if self._staging is None:
            self._staging = torch.empty(self.max_frame, dtype=torch.uint8, device=self.device)
        return self._staging[:nbytes]

    def _wait(self, work: Any, deadline: float, what: str) -> None:
        left = deadline - time.monotonic()
        try:
            if left <= 0:
                raise TimeoutError
            work.wait(_td(left))
        except Exception as exc:
            self.broken = True  # a failed or timed-out wait leaves the group unusable
            if time.monotonic() >= deadline - 0.001:
                raise DeadlineExpiredError(f"deadline passed waiting to {what}") from None
            raise PeerError(f"{what} failed: {str(exc)[:300]}") from None
        self.last_used = time.monotonic()

    def post(self, header: FrameHeader, payload: torch.Tensor | None = None) -> list[Any]:
        """Start sending one message; returns the works to `finish`."""
        raw = torch.frombuffer(bytearray(header.encode()), dtype=torch.uint8).to(self.device)
        works = [self.group.send([raw], self.peer, 0)]
        if payload is not None and payload.numel():
            works.append(self.group.send([payload], self.peer, 0))
        return works

    def finish(self, works: list[Any], deadline: float) -> None:
        for work in works:
            self._wait(work, deadline, "send")

    def send(self, header: FrameHeader, payload: torch.Tensor | None, deadline: float) -> None:
        self.finish(self.post(header, payload), deadline)

    def post_recv_header(self) -> Any:
        return self.group.recv([self._header], self.peer, 0)

    def finish_recv_header(self, work: Any, deadline: float) -> FrameHeader:
        self._wait(work, deadline, "receive a header")
        return decode_header(self._header.cpu().numpy().tobytes())

    def recv_header(self, deadline: float) -> FrameHeader:
        return self.finish_recv_header(self.post_recv_header(), deadline)

    def recv_payload(self, into: torch.Tensor, deadline: float) -> torch.Tensor:
        if into.numel():
            self._wait(self.group.recv([into], self.peer, 0), deadline, "receive a payload")
        return into

    def receiver(self, deadline: float) -> Callable[[torch.Tensor], torch.Tensor]:
        """`recv_payload` for `ReceiverCore.on_frame_into`: a receive that fails aborts the
        link before returning, so no late byte can land in the tensor it was reading into."""

        def receive(into: torch.Tensor) -> torch.Tensor:
            try:
                return self.recv_payload(into, deadline)
            except BaseException:
                self.abort()
                raise

        return receive

    def abort(self) -> None:
        """Stop the group; pending waits on it fail (abort() instead would crash at exit)."""
        if self.closed:
            return
        self.broken = self.closed = True
        with contextlib.suppress(Exception):
            self.group.shutdown()


def _control_payload(header: FrameHeader, link: _Link, deadline: float) -> bytes:
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
                host, port, None, True, _td(HANDSHAKE_SECONDS), wait_for_workers=False
            )
        except Exception as exc:
            raise OSError(f"gloo receiver could not bind {bind}: {exc}") from None
        self._port = int(self._store.port)
        self._links: set[_Link] = set()  # guarded by _lock
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
            self._store.queue_push(_QUEUE, _CLOSE)
        self._accepter.join(5)
        with self._lock:
            links = list(self._links)
        for link in links:
            link.abort()
        self._store = None  # the last reference stops the store's server

    def _accept_loop(self) -> None:
        waiter = self._store.clone()
        waiter.set_timeout(_td(60.0))
        while not self._closed:
            try:
                link_id = waiter.queue_pop(_QUEUE).decode()
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
            group = _new_group(
                torch.distributed.PrefixStore(scope, self._store), _RECEIVER, self._device,
                self._host,
            )  # fmt: skip
            for key in ("hello", "ack"):
                self._store.delete_key(scope + key)
        except Exception:  # a half-open handshake: the sender times out and gives up
            return
        link = _Link(group, _SENDER, self._device, max_frame)
        with self._lock:
            self._links.add(link)
        try:
            self._loop(link)
        finally:
            link.abort()
            with self._lock:
                self._links.discard(link)

    def _loop(self, link: _Link) -> None:
        begun: set[bytes] = set()
        try:
            while not self._closed:
                header = link.recv_header(time.monotonic() + IDLE_SECONDS)
                reply = self._handle(link, header, begun)
                if reply is not None:
                    link.send(*reply, deadline=time.monotonic() + REPLY_SECONDS)
        except TransferError as exc:
            self.core.fail_ids(begun, PeerError(f"sender link lost: {exc}"))

    def _handle(
        self, link: _Link, header: FrameHeader, begun: set[bytes]
    ) -> tuple[FrameHeader, torch.Tensor | None] | None:
        """Read the message's payload (keeps the stream in step; a FRAME's straight into the
        reserved blocks when they are one run), then apply it to the core."""
        deadline = time.monotonic() + REPLY_SECONDS
        kind, tid, epoch = header.msg_type, header.transfer_id, header.epoch
        if kind is MsgType.FRAME and header.payload_len > link.max_frame:
            raise FrameError("payload_len", f"{header.payload_len} above {link.max_frame}")
        data = b"" if kind is MsgType.FRAME else _control_payload(header, link, deadline)
        try:
            if kind is MsgType.FRAME:
                bound = min(deadline, time.monotonic() + payload_seconds(header.payload_len))
                self.core.on_frame_into(header, link.receiver(bound), link.staging)
                return frame_header(MsgType.FRAME_ACK, tid, epoch), None
            if kind is MsgType.BEGIN:
                self.core.on_begin(header, data)
                begun.add(tid)
                return frame_header(MsgType.ACCEPT, tid, epoch), None
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
            if link.broken:  # the payload was not read: the link is out of step
                raise
            wire = error_to_wire(exc)
            body = torch.frombuffer(bytearray(wire), dtype=torch.uint8).to(link.device)
            return frame_header(MsgType.ERROR, tid, epoch, wire), body


class _LinkPool:
    """Idle links per (receiver address, layout); a link is built only when none is idle."""

    def __init__(self) -> None:
        self._idle: dict[tuple[str, bytes], list[_Link]] = {}
        self._stores: dict[str, Any] = {}
        self._lock = threading.Lock()

    def take(self, address: str, layout: KVLayout, device: torch.device, max_frame: int) -> _Link:
        key = (address, layout.to_bytes())
        with self._lock:
            idle = self._idle.get(key, [])
            while idle:
                link = idle.pop()
                fresh = time.monotonic() - link.last_used < IDLE_SECONDS / 2
                if fresh and not link.broken and link.max_frame >= max_frame:
                    return link
                link.abort()
        return self._connect(address, layout, device, max_frame)

    def give(self, address: str, layout: KVLayout, link: _Link) -> None:
        if link.broken:
            link.abort()
            return
        with self._lock:
            idle = self._idle.setdefault((address, layout.to_bytes()), [])
            if len(idle) < _POOL_PER_PEER:
                idle.append(link)
                return
        link.abort()

    def close_all(self) -> None:
        """Shut every idle link down (at exit: groups must not outlive the interpreter)."""
        with self._lock:
            links = [link for idle in self._idle.values() for link in idle]
            self._idle.clear()
            self._stores.clear()
        for link in links:
            link.abort()

    def _store(self, address: str) -> Any:
        with self._lock:
            store = self._stores.get(address)
        if store is None:
            host, port = split_host_port(address)
            try:  # a plain connect first: the store client would retry a refusal for its timeout
                socket.create_connection((host, port), timeout=HANDSHAKE_SECONDS).close()
                store = dist.TCPStore(
                    host, port, None, False, _td(HANDSHAKE_SECONDS), wait_for_workers=False
                )
            except Exception as exc:
                raise PeerError(f"cannot reach gloo receiver {address}: {exc}") from None
            with self._lock:
                self._stores[address] = store
        return store

    def _connect(
        self, address: str, layout: KVLayout, device: torch.device, max_frame: int
    ) -> _Link:
        store = self._store(address)
        link_id = os.urandom(12).hex()
        scope = f"kvmesh/link/{link_id}/"
        hello = layout.to_bytes() + b"\0" + json.dumps({"max_frame": max_frame}).encode()
        try:
            store.set(scope + "hello", hello)
            store.queue_push(_QUEUE, link_id)
            ack = json.loads(store.get(scope + "ack"))
        except Exception as exc:
            with self._lock:
                self._stores.pop(address, None)  # the receiver may have restarted
            raise PeerError(f"gloo handshake with {address} failed: {exc}") from None
        layout.check_compatible(KVLayout.from_bytes(str(ack.get("layout", "")).encode()))
        if "error" in ack:
            raise parse_wire_error(str(ack["error"]).encode())
        host, _ = split_host_port(address)
        try:
            group = _new_group(
                dist.PrefixStore(scope, store), _SENDER, device, _local_host_towards(host)
            )
        except Exception as exc:
            raise PeerError(f"gloo group with {address} failed: {exc}") from None
        return _Link(group, _RECEIVER, device, max_frame)


_POOL = _LinkPool()
atexit.register(_POOL.close_all)


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
        self._link: _Link | None = _POOL.take(address, self.layout, self.device, self._max_frame)

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
            _POOL.give(self.address, self.layout, link)

    def _transfer(self, plan: SendPlan, record: TransferRecord, waiter: Waiter) -> None:
        link = self._link
        if link is None or link.broken or time.monotonic() - link.last_used > IDLE_SECONDS / 2:
            if link is not None:
                link.abort()
            self._link = None
            link = self._link = _POOL.take(self.address, self.layout, self.device, self._max_frame)
        try:
            self._run(link, plan, waiter)
        except TransferError:
            if link.broken:
                link.abort()
                self._link = None
            raise

    def _run(self, link: _Link, plan: SendPlan, waiter: Waiter) -> None:
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

    def _check_or_cancel(self, link: _Link, plan: SendPlan, waiter: Waiter) -> None:
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
        link: _Link,
        header: FrameHeader,
        body: torch.Tensor | None,
        waiter: Waiter,
        want: MsgType = MsgType.ACCEPT,
    ) -> None:
        self._reply(link, [*link.post(header, body), link.post_recv_header()], want, waiter)

    def _reply(self, link: _Link, works: list[Any], want: MsgType, waiter: Waiter) -> None:
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
