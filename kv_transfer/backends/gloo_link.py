"""gloo/NCCL links of the `gloo` backend: a two-rank process group per sender/receiver pair,
the messages on it (`Link`), and the per-peer pool that reuses them (`POOL`).

A link carries one transfer at a time, with up to `window` frames in flight (negotiated in the
HELLO: 2 when both sides support it on a host link, else 1). Every wait has a timeout; a wait
that fails or times out marks the link broken, and a broken link is closed (`abort`) rather
than reused. Closing a link ends every wait on it at once, on both sides: a receiver's close or
a sender's abort ends the peer's link thread, whoever still holds the link.

A receiver may stop and a new one start at the same address (a restarted worker with a fixed
port). Links and the store client built with the old one are then useless. The pool connects
to a receiver through a `Rendezvous`: the store client and an idle watch connection to the same
store server. A receiver that stopped closes that connection, so `Rendezvous.gone` sees it
without blocking. The pool then drops the store client and every link built through it
(`Link.gone`). A death not yet seen (the close still on its way) shows up as a failed send or
receive instead; `LinkPool.forget` then drops them.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import json
import os
import select
import socket
import threading
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from kv_transfer.backends import gloo_handshake
from kv_transfer.errors import (
    AuthenticationError,
    DeadlineExpiredError,
    FrameError,
    PeerError,
    TransferError,
    parse_wire_error,
)
from kv_transfer.header import HEADER_SIZE, FrameHeader, decode_header
from kv_transfer.layout import KVLayout

if not torch.distributed.is_available():  # pragma: no cover - builds without distributed
    raise ImportError("torch.distributed is not available in this torch build")

import torch.distributed as dist

HANDSHAKE_SECONDS = 10.0
IDLE_SECONDS = 600.0  # a receiver drops a link idle this long; senders rebuild theirs before
QUEUE = "kvmesh/hellos"
RECEIVER_RANK, SENDER_RANK = 0, 1
_ABORT_TAG = 1  # never sent with (messages use tag 0): a receive on it can only time out
_POOL_PER_PEER = 4
WINDOW = 2  # frames a sender keeps in flight on a host (gloo) link whose receiver agreed to it


def window_for(device: torch.device) -> int:
    """Frames in flight a link on `device` can carry: `WINDOW` for host caches (gloo), 1 for
    CUDA caches. NCCL runs a pair's sends and receives in the order posted, on one stream, so a
    receive of frame k's answer posted before the next frame's header is sent would wait for
    an answer the receiver only sends after that header."""
    return 1 if device.type == "cuda" else WINDOW


def agreed_window(theirs: object, device: torch.device) -> int:
    """The frames in flight a peer named in its HELLO or ack, capped at what a link on
    `device` carries; 1 when it named none (or nonsense)."""
    ours = window_for(device)
    return min(theirs, ours) if isinstance(theirs, int) and theirs >= 1 else 1


def td(seconds: float) -> datetime.timedelta:
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


def new_group(store: Any, rank: int, device: torch.device, host: str) -> Any:
    """A two-rank process group over `store`: NCCL for CUDA caches, gloo otherwise."""
    if device.type == "cuda":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = td(HANDSHAKE_SECONDS)
        return dist.ProcessGroupNCCL(store, rank, 2, options)
    options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
    options._timeout = td(HANDSHAKE_SECONDS)
    options._threads = 1
    return dist.ProcessGroupGloo(store, rank, 2, options)


class HeaderRecv(NamedTuple):
    """A posted receive of one message header: its work and its own buffer (uint8 [80])."""

    work: Any
    buf: torch.Tensor


class Link:
    """One process group between a sender and a receiver, used by one transfer at a time;
    `window` is how many frames the sender may have in flight (1 or `WINDOW`)."""

    def __init__(
        self,
        group: Any,
        peer: int,
        device: torch.device,
        max_frame: int,
        window: int = 1,
        rendezvous: Rendezvous | None = None,
    ) -> None:
        self.group = group
        self.peer = peer
        self.device = device
        self.max_frame = max_frame
        self.window = window
        self.rendezvous = rendezvous  # a sender's: how it reached the receiver
        self.born = self.last_used = time.monotonic()
        self.broken = False
        self.closed = False

    @property
    def gone(self) -> bool:
        """Never blocks. True when the link is broken or closed, or when the receiver that
        served its handshake has stopped (`Rendezvous.gone`). A sender's check only."""
        return self.broken or (self.rendezvous is not None and self.rendezvous.gone)

    def _wait(self, work: Any, deadline: float, what: str) -> None:
        left = deadline - time.monotonic()
        try:
            if left <= 0:
                raise TimeoutError
            work.wait(td(left))
        except Exception as exc:
            self.broken = True  # a failed or timed-out wait leaves the group unusable
            if time.monotonic() >= deadline - 0.001:
                raise DeadlineExpiredError(f"deadline passed waiting to {what}") from None
            raise PeerError(f"{what} failed: {str(exc)[:300]}") from None
        self.last_used = time.monotonic()

    def _start(self, op: Callable[[], Any], what: str) -> Any:
        """Post one send or receive; a refusal (the peer closed the connection) breaks the
        link and is a PeerError, like a failed wait."""
        try:
            return op()
        except Exception as exc:
            self.broken = True
            raise PeerError(f"{what} failed: {str(exc)[:300]}") from None

    def post(self, header: FrameHeader, payload: torch.Tensor | None = None) -> list[Any]:
        """Start sending one message; returns the works to `finish`. A gloo send completes
        only once the peer posted the matching receive."""
        raw = torch.frombuffer(bytearray(header.encode()), dtype=torch.uint8).to(self.device)
        works = [self._start(lambda: self.group.send([raw], self.peer, 0), "send")]
        if payload is not None and payload.numel():
            works.append(self._start(lambda: self.group.send([payload], self.peer, 0), "send"))
        return works

    def finish(self, works: list[Any], deadline: float) -> None:
        for work in works:
            self._wait(work, deadline, "send")

    def send(self, header: FrameHeader, payload: torch.Tensor | None, deadline: float) -> None:
        self.finish(self.post(header, payload), deadline)

    def post_recv_header(self) -> HeaderRecv:
        """Start receiving the next header, into a buffer of its own: several may be posted
        (gloo matches them to messages in order)."""
        buf = torch.empty(HEADER_SIZE, dtype=torch.uint8, device=self.device)
        work = self._start(lambda: self.group.recv([buf], self.peer, 0), "receive a header")
        return HeaderRecv(work, buf)

    def finish_recv_header(self, posted: HeaderRecv, deadline: float) -> FrameHeader:
        self._wait(posted.work, deadline, "receive a header")
        return decode_header(posted.buf.cpu().numpy().tobytes())

    def recv_header(self, deadline: float) -> FrameHeader:
        return self.finish_recv_header(self.post_recv_header(), deadline)

    def post_recv_payload(self, into: torch.Tensor) -> Any:
        """Start receiving a payload into `into` (non-empty); `finish_recv_payload` waits."""
        return self._start(lambda: self.group.recv([into], self.peer, 0), "receive a payload")

    def finish_recv_payload(self, work: Any, deadline: float) -> None:
        self._wait(work, deadline, "receive a payload")

    def recv_payload(self, into: torch.Tensor, deadline: float) -> torch.Tensor:
        if into.numel():
            self.finish_recv_payload(self.post_recv_payload(into), deadline)
        return into

    def abort(self) -> None:
        """Close the link for good, from any thread: a wait on it, here or at the peer, pending
        now or later, fails at once. gloo's `shutdown()` does neither: its connections close
        only with the last reference to the group, which a kept error's traceback can hold for
        as long as the error is kept. A receive that times out does: gloo then closes every
        connection of the group (`_close_gloo`). (The group's abort() would crash at exit.)"""
        if self.closed:
            return
        self.broken = self.closed = True
        if self.device.type != "cuda":
            self._close_gloo()
        with contextlib.suppress(Exception):
            self.group.shutdown()

    def _close_gloo(self) -> None:
        """Time out a receive on a tag nothing is sent with; gloo answers by closing the
        group's connections, failing every wait on them on both sides."""
        spare = torch.empty(1, dtype=torch.uint8)
        with contextlib.suppress(Exception):
            self.group.recv([spare], self.peer, _ABORT_TAG).wait(td(0.001))


class Rendezvous:
    """A sender's way to one receiver: a store client, and an idle watch connection to the same
    store server. The watch never sends, and a store server never writes first. So the watch
    is readable only once the server closed it: the receiver stopped, or its process died."""

    def __init__(self, address: str, timeout: float) -> None:
        """Connect both; PeerError when the receiver cannot be reached. A plain connect comes
        first: the store client would retry a refused connection for its whole timeout."""
        host, port = split_host_port(address)
        self.address = address
        try:
            self.watch = socket.create_connection((host, port), timeout=max(0.001, timeout))
        except OSError as exc:
            raise PeerError(f"cannot reach gloo receiver {address}: {exc}") from None
        try:
            self.store: Any = dist.TCPStore(
                host, port, None, False, td(HANDSHAKE_SECONDS), wait_for_workers=False
            )
        except Exception as exc:
            self.watch.close()
            raise PeerError(f"cannot reach gloo receiver {address}: {exc}") from None

    def client(self, end: float) -> Any:
        """A new store client of this receiver, for one handshake: its connect and every
        operation on it give up at `end`. A plain connect comes first: the store client would
        retry a refused connection (a receiver stopped since this rendezvous was made, its
        close not seen yet) for its whole timeout, past `end`; refused, it raises at once."""
        host, port = split_host_port(self.address)
        socket.create_connection((host, port), timeout=max(0.001, end - time.monotonic())).close()
        return dist.TCPStore(
            host, port, None, False, td(end - time.monotonic()), wait_for_workers=False
        )

    @property
    def gone(self) -> bool:
        """Never blocks: has the store server closed the watch connection?"""
        try:
            return bool(select.select([self.watch], [], [], 0)[0])
        except (OSError, ValueError):  # closed here
            return True

    def __del__(self) -> None:
        # Links keep their rendezvous: the watch closes with the last of them.
        watch = getattr(self, "watch", None)
        if watch is not None:
            watch.close()


class LinkPool:
    """Idle links per (receiver address, layout, cluster token); a link is built only when none
    is idle. Idle links and rendezvous of a receiver that is gone are dropped, never handed
    out. A link built with a token proved it to the receiver, and the receiver to it."""

    def __init__(self) -> None:
        self._idle: dict[tuple[str, bytes, str], list[Link]] = {}
        self._stores: dict[str, Rendezvous] = {}
        self._lock = threading.Lock()

    def take(
        self,
        address: str,
        layout: KVLayout,
        device: torch.device,
        max_frame: int,
        deadline: float | None = None,
        token: str | None = None,
    ) -> Link:
        """An idle link to `address` built with `token`, or a new one (`connect`)."""
        key = (address, layout.to_bytes(), token or "")
        with self._lock:
            idle = self._idle.get(key, [])
            while idle:
                link = idle.pop()
                fresh = time.monotonic() - link.last_used < IDLE_SECONDS / 2
                if fresh and not link.gone and link.max_frame >= max_frame:
                    return link
                link.abort()
        return self.connect(address, layout, device, max_frame, deadline, token)

    def give(self, address: str, layout: KVLayout, link: Link, token: str | None = None) -> None:
        """Keep `link` (built with `token`) for reuse, or abort it."""
        if link.gone:
            link.abort()
            return
        with self._lock:
            idle = self._idle.setdefault((address, layout.to_bytes(), token or ""), [])
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

    def forget(self, address: str, rendezvous: Rendezvous | None) -> None:
        """A link built through `rendezvous` failed in a way a stopped receiver explains:
        drop that store client and abort the idle links built through it (the next ones are
        built through a new rendezvous). Those of a newer rendezvous are kept."""
        if rendezvous is None:
            return
        doomed: list[Link] = []
        with self._lock:
            if self._stores.get(address) is rendezvous:
                del self._stores[address]
            for (peer, *_), idle in self._idle.items():
                if peer == address:
                    doomed += [link for link in idle if link.rendezvous is rendezvous]
                    idle[:] = [link for link in idle if link.rendezvous is not rendezvous]
        for link in doomed:
            link.abort()

    def connect(
        self,
        address: str,
        layout: KVLayout,
        device: torch.device,
        max_frame: int,
        deadline: float | None = None,
        token: str | None = None,
    ) -> Link:
        """A new link to `address` (the idle ones are left alone). The receiver's answer is
        awaited until `deadline` (at most `HANDSHAKE_SECONDS`). A store client kept from an
        earlier handshake that fails before that (a receiver that restarted since) is dropped,
        and the handshake is tried once more with a new one: it only names a new link id.
        With `token` the HELLO is signed and an answer that does not prove it is refused
        (`AuthenticationError`)."""
        end = time.monotonic() + HANDSHAKE_SECONDS
        end = end if deadline is None else min(end, deadline)
        rendezvous, kept = self._rendezvous(address, end)
        try:
            return self._handshake(rendezvous, layout, device, max_frame, end, token)
        except _HandshakeError as exc:
            with self._lock:
                if self._stores.get(address) is rendezvous:
                    del self._stores[address]
            if not kept or exc.expired:
                raise exc.final(deadline) from None
        rendezvous, _ = self._rendezvous(address, end)
        try:
            return self._handshake(rendezvous, layout, device, max_frame, end, token)
        except _HandshakeError as exc:
            raise exc.final(deadline) from None

    def _rendezvous(self, address: str, end: float) -> tuple[Rendezvous, bool]:
        """The kept rendezvous with `address` unless its receiver is gone, else a new one;
        and whether it was kept."""
        with self._lock:
            kept = self._stores.get(address)
            if kept is not None and kept.gone:
                del self._stores[address]
                kept = None
        if kept is not None:
            return kept, True
        left = end - time.monotonic()
        if left <= 0:
            raise DeadlineExpiredError(f"deadline passed before reaching {address}")
        rendezvous = Rendezvous(address, min(left, HANDSHAKE_SECONDS))
        with self._lock:
            self._stores[address] = rendezvous
        return rendezvous, False

    def _handshake(
        self,
        rendezvous: Rendezvous,
        layout: KVLayout,
        device: torch.device,
        max_frame: int,
        end: float,
        token: str | None,
    ) -> Link:
        """HELLO under a new link id (signed with `token`), the receiver's ack (awaited until
        `end`, deleted once read), then the group. A failed store operation raises
        `_HandshakeError`, an ack not proving `token` `AuthenticationError`."""
        address = rendezvous.address
        link_id = os.urandom(12).hex()
        scope = gloo_handshake.scope(link_id)
        ours = layout.to_bytes()
        extras: dict[str, Any] = {"max_frame": max_frame, "window": window_for(device)}
        if token:  # the signed time lets the receiver refuse a replayed copy
            extras = gloo_handshake.stamped(extras)
        extras = gloo_handshake.sign(token, "hello", link_id, ours, extras)
        hello = ours + b"\0" + json.dumps(extras).encode()
        try:  # a store client per handshake: concurrent ones to one receiver wait apart
            store = rendezvous.client(end)
            store.set(scope + "hello", hello)
            store.queue_push(QUEUE, link_id)
            store.wait([scope + "ack"], td(end - time.monotonic()))
            ack = json.loads(store.get(scope + "ack"))
        except Exception as exc:  # the receiver deletes the HELLO when it reads it
            expired = time.monotonic() >= end - 0.001
            raise _HandshakeError(address, str(exc)[:300], expired) from None
        with contextlib.suppress(Exception):
            store.delete_key(scope + "ack")  # the receiver waits for that to end a refusal
        if not isinstance(ack, dict):
            raise PeerError(f"gloo receiver {address} answered nonsense")
        if not gloo_handshake.verified(token, "ack", link_id, b"", ack):
            raise AuthenticationError(f"gloo receiver {address} did not prove the cluster token")
        layout.check_compatible(KVLayout.from_bytes(str(ack.get("layout", "")).encode()))
        if "error" in ack:
            raise parse_wire_error(str(ack["error"]).encode())
        host, _ = split_host_port(address)
        try:
            group = new_group(
                dist.PrefixStore(scope, store), SENDER_RANK, device, _local_host_towards(host)
            )
        except Exception as exc:
            raise PeerError(f"gloo group with {address} failed: {exc}") from None
        window = agreed_window(ack.get("window"), device)  # 1 when the receiver names none
        return Link(group, RECEIVER_RANK, device, max_frame, window, rendezvous)


class _HandshakeError(Exception):
    """A store operation of a handshake with `address` failed (`cause`); `expired`: the time
    for the receiver's answer ran out (then a retry could only wait longer)."""

    def __init__(self, address: str, cause: str, expired: bool) -> None:
        super().__init__(cause)
        self.address = address
        self.cause = cause
        self.expired = expired

    def final(self, deadline: float | None) -> TransferError:
        """What the caller sees: DeadlineExpiredError when its own `deadline` ran out, else
        PeerError."""
        if self.expired and deadline is not None and time.monotonic() >= deadline - 0.001:
            return DeadlineExpiredError(f"deadline passed in the handshake with {self.address}")
        return PeerError(f"gloo handshake with {self.address} failed: {self.cause}")


POOL = LinkPool()
atexit.register(POOL.close_all)
