"""`torch.distributed` point-to-point backend: gloo for CPU caches, NCCL for CUDA caches.

Rendezvous: the receiver serves a `TCPStore` on its advertised `host:port`. A sender pushes a
HELLO (layout + largest frame) under a random link id; the receiver answers with its layout or
a refusal, and both build a two-rank process group (receiver rank 0, sender rank 1) over a
`PrefixStore` of that link. Given the cluster token (`security=`), both sides sign what they
write and check what they read (`gloo_handshake`): the receiver drops a HELLO without a valid
proof before it takes a handshake slot, unanswered, and the sender refuses an unsigned answer
(`AuthenticationError`). Without a token the receiver trusts whoever reaches its store. The
receiver deletes a link's store keys once its handshake failed or was refused, or the link
closed. Groups are expensive, so a link is pooled per peer and reused by
every later transfer; a link whose wait failed or timed out is aborted and rebuilt on the next
transfer. A link whose receiver stopped since it was built (a worker restarted at the same
address) is rebuilt before use when the pool already saw the receiver go (`Link.gone`, also
`Sender.stale`); when BEGIN finds it first (it cannot be sent, or its answer cannot be read), the
transfer builds one new link and sends BEGIN again, within its deadline (`Sender._open_link`).

Messages on a link (in order): header `[80]` uint8, then payload `[payload_len]` uint8 when
`payload_len > 0` (never unpickled). Sender → receiver: BEGIN (destination ids), FRAME, END,
CANCEL. Receiver → sender: ACCEPT, FRAME_ACK, DONE, ERROR (`code\\0message`), exactly one per
BEGIN, FRAME and END, in order (none per CANCEL). Every wait has a timeout (the transfer
deadline, or the idle limit of a link).

Two frames in flight on host (gloo) links (`WINDOW`, agreed in the HELLO; a peer that does not
name a window gets one, and so does every CUDA link: NCCL runs a pair's operations in the order
posted, so an answer's receive posted ahead of the next frame would wait for itself). The sender
prepares frame k+1 while frames k-1 and k travel, then waits for k-1's answer before it posts
k+1. The receiver posts the receive of frame k's payload into one of two staging buffers (the
second made when a link first has two frames), then checks, scatters and answers frame k-1 from
the other while k's bytes arrive: a frame is answered when the next message's header arrives
(END and CANCEL included), so the wire carries the next frame while the receiver writes the
previous one. With one frame in flight each frame is answered as soon as it is written. A gloo
send completes only once the peer posted the matching receive, and a sender reads an ERROR's
payload only when it collects that answer, possibly after its own next message (a CANCEL, the
next part of a streamed transfer): so the receiver finishes an answer's sends only before it
sends the next one (`_Replies`), and the sender posts only the oldest answer's receive
(`_InFlight`). A sender that stops with answers owed sends CANCEL (unless END went out) and
collects them; any answer it cannot read breaks the link, which is then rebuilt rather than
reused out of step.

A frame whose source blocks are one run of the cache (`BlockStore.run_view`: consecutive block
ids of a host cache without scales are one byte range) is sent from the cache itself; others are
gathered into one of window + 1 staging buffers (made as needed). The receiver always reads a
payload into one of its link's staging buffers, then checks and scatters it: reading straight
into the reserved blocks would leave them exposed to a late write whenever a receive fails
half-way (a peer stopped mid-frame) and the blocks go back to the pool before the transport is
certainly silent, which this module cannot prove for gloo's transport threads.

Where the time goes (2-core machine, 128 MiB, host cache): per byte, gloo's TCP loop threads
(epoll wake-ups and socket copies) cost more than the copies around them. With one frame in
flight, the receiver waited 56-62 ms for the payloads and spent 30-35 ms checking and
scattering them, one after the other; the second frame in flight overlaps the two. 16 MiB
frames (`FRAME_BYTES`) took about 0.6x the CPU of 2 MiB frames for the same bytes.
"""

from __future__ import annotations

import collections
import contextlib
import json
import socket
import threading
import time
from typing import TYPE_CHECKING, Any

import torch

from kv_transfer.backends import gloo_handshake
from kv_transfer.backends.gloo_link import (
    HANDSHAKE_SECONDS,
    IDLE_SECONDS,
    POOL,
    QUEUE,
    RECEIVER_RANK,
    SENDER_RANK,
    HeaderRecv,
    Link,
    agreed_window,
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
from kv_transfer.layout import KVLayout
from kv_transfer.state import TransferRecord

if TYPE_CHECKING:
    from kvmesh.security import Security

if not torch.distributed.is_available():  # pragma: no cover - builds without distributed
    raise ImportError("torch.distributed is not available in this torch build")

import torch.distributed as dist

REPLY_SECONDS = 10.0  # receiver's bound on delivering one reply
MAX_FRAME_BYTES = 256 << 20
FRAME_BYTES = 16 << 20  # measured: 16 MiB frames took 0.6x the CPU of 2 MiB ones per byte
_CLOSE = "!close"
MAX_PENDING_LINKS = 16  # link handshakes a receiver runs at once (a link per sending peer)
CLOSE_SECONDS = 5.0  # a closing receiver's wait for its handshakes under way to fail


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
    """Serves a TCPStore at `bind` (`HOST:PORT`, port 0 picks one) and one thread per link.
    With `security`'s cluster token, only HELLOs proving it are served (TLS does not apply)."""

    def __init__(
        self,
        store: BlockStore,
        *,
        bind: str = "127.0.0.1:0",
        advertise: str | None = None,
        security: Security | None = None,
    ) -> None:
        super().__init__(store)
        self._token = security.token if security is not None else None
        self._served = gloo_handshake.Served()  # link ids whose HELLO was taken (replays)
        host, port = split_host_port(bind)
        self._host = advertise or (host if host not in ("0.0.0.0", "::") else socket.getfqdn())
        self._device = store.cache.device
        try:
            self._store: Any = dist.TCPStore(
                host, port, None, True, td(HANDSHAKE_SECONDS), wait_for_workers=False
            )
        except Exception as exc:
            raise OSError(f"--transfer-port: cannot bind {bind} (gloo): {exc}") from None
        self._port = int(self._store.port)
        self._links: set[Link] = set()  # guarded by _lock
        self._slots = MAX_PENDING_LINKS
        self._pending = threading.BoundedSemaphore(self._slots)  # handshakes under way
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
        self._await_handshakes(time.monotonic() + CLOSE_SECONDS)

    def _await_handshakes(self, deadline: float) -> None:
        """Wait until no handshake is under way (each holds a slot; with the store server
        stopped they fail at once), at most until `deadline`: a thread still building a
        group when the interpreter exits aborts the process."""
        for _ in range(self._slots):
            if not self._pending.acquire(timeout=max(0.0, deadline - time.monotonic())):
                return

    def _store_clients(self) -> tuple[Any, Any] | None:
        """The accept loop's two store clients (the queue's waiter, the HELLOs' reader), made
        again until they connect or the receiver closes: a torch `TCPStore` connect takes 5 s
        now and then (BENCHMARKS.md "A gloo rendezvous store's connect"), which can outlast
        the store's timeout, and an accept loop that gave up would serve no link again."""
        while not self._closed:
            try:
                waiter = self._store.clone()
                reader = self._store.clone()  # HELLOs: present when queued, so read at once
            except Exception:
                time.sleep(0.05)
                continue
            waiter.set_timeout(td(60.0))
            reader.set_timeout(td(1.0))
            return waiter, reader
        return None

    def _accept_loop(self) -> None:
        clients = self._store_clients()
        if clients is None:
            return
        waiter, reader = clients
        while not self._closed:
            try:
                link_id = waiter.queue_pop(QUEUE).decode()
            except Exception:  # idle poll timed out: look at `_closed` again
                continue
            if self._closed:
                return
            if link_id == _CLOSE:  # only a wake-up: whoever reaches the store can push it
                continue
            try:
                self._start_link(reader, link_id)
            except Exception:  # whatever a stranger queued is dropped; the loop accepts on
                continue

    def _start_link(self, reader: Any, link_id: str) -> None:
        """Serve `link_id` on its own thread, unless its HELLO is not in the store (a sender
        writes it before it queues the id: anything else was pushed by whoever reached the
        store), does not prove the cluster token when the receiver has one, or no handshake
        slot frees within HANDSHAKE_SECONDS (`MAX_PENDING_LINKS` run at once, each waiting at
        most that long for its peer). Such ids are dropped, so ids pushed by anyone cannot pile
        up threads, a HELLO without the token never takes a slot, and a burst of real senders
        waits for a slot in queue order. The HELLO is read once, here, and deleted from the
        store: the handshake answers what was checked."""
        key = gloo_handshake.scope(link_id) + "hello"
        try:
            if not reader.check([key]):
                return
            hello = reader.get(key)
            reader.delete_key(key)
        except Exception:  # the store is going away (close): the accept loop decides
            return
        parsed = _parse_hello(hello)
        if parsed is None or not self._proven(link_id, *parsed):
            return
        if not self._take_slot(time.monotonic() + HANDSHAKE_SECONDS):
            return
        thread = threading.Thread(
            target=self._serve, args=(link_id, *parsed), name="kv-gloo-link", daemon=True
        )
        try:
            thread.start()
        except RuntimeError:  # no thread (the process is out of them): dropped, slot freed
            self._pending.release()

    def _proven(self, link_id: str, layout: bytes, fields: dict[str, Any]) -> bool:
        """Whether a HELLO of `layout` and `fields` proves the cluster token, was signed
        within REPLAY_SECONDS and is the first HELLO accepted for `link_id` (always true
        without a token)."""
        if self._token is None:
            return True
        return (
            gloo_handshake.verified(self._token, "hello", link_id, layout, fields)
            and gloo_handshake.fresh(fields, time.time())
            and self._served.first(link_id, time.monotonic())
        )

    def _take_slot(self, deadline: float) -> bool:
        """A handshake slot, waited for until `deadline` or until the receiver closes."""
        while not self._closed:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            if self._pending.acquire(timeout=min(left, 0.25)):
                return True
        return False

    def _serve(self, link_id: str, layout: bytes, extras: dict[str, Any]) -> None:
        """Run `link_id`'s handshake (holding a slot), then its link; the link's store keys
        are deleted once the handshake failed or was refused, or the link closed."""
        client = None
        link = None
        try:  # a store client per handshake: one waiting for its peer blocks no other
            client = self._store.clone()
            link = self._handshake(client, link_id, layout, extras)
        except Exception:  # the store is gone (close)
            pass
        finally:
            if link is None and client is not None:
                gloo_handshake.forget(client, link_id)
            self._pending.release()
        if link is None:
            return
        with self._lock:
            self._links.add(link)
        try:
            self._loop(link)
        finally:
            link.abort()
            with self._lock:
                self._links.discard(link)
            gloo_handshake.forget(client, link_id)

    def _handshake(
        self, client: Any, link_id: str, layout: bytes, extras: dict[str, Any]
    ) -> Link | None:
        """Answer a HELLO of the sender's `layout` bytes and `extras` (signed with the cluster
        token when the receiver has one) and build the link's process group; None when refused
        (once the sender collected the refusal, or HANDSHAKE_SECONDS passed) or when the
        sender did not follow through."""
        scope = gloo_handshake.scope(link_id)
        try:
            theirs = KVLayout.from_bytes(layout)
            ours = self.layout.to_bytes()
            max_frame = extras.get("max_frame")
            window = agreed_window(extras.get("window"), self._device)
            ack: dict[str, Any] = {"layout": ours.decode(), "window": window}
            try:  # the sender raises a layout mismatch itself, from our layout
                self.layout.check_compatible(theirs)
                if not isinstance(max_frame, int) or not 0 < max_frame <= MAX_FRAME_BYTES:
                    raise FrameError("max_frame", f"must be in (0, {MAX_FRAME_BYTES}]")
            except TransferError as exc:
                ack["error"] = error_to_wire(exc).decode()
            ack = gloo_handshake.sign(self._token, "ack", link_id, b"", ack)
            client.set(scope + "ack", json.dumps(ack))
            if "error" in ack or not isinstance(max_frame, int):
                _await_collected(client, scope + "ack", time.monotonic() + HANDSHAKE_SECONDS)
                return None
            group = new_group(
                torch.distributed.PrefixStore(scope, client), RECEIVER_RANK, self._device,
                self._host,
            )  # fmt: skip
        except Exception:  # a half-open handshake: the sender times out and gives up
            return None
        with contextlib.suppress(Exception):  # a built group is served even if this fails
            client.delete_key(scope + "ack")  # the sender read it before it joined
        return Link(group, SENDER_RANK, self._device, max_frame, window)

    def _loop(self, link: Link) -> None:
        begun: set[tuple[bytes, int]] = set()  # (transfer id, epoch) begun on this link
        staging: list[torch.Tensor] = []  # uint8 [max_frame] each, made when first needed:
        # frame k arrives into one while k-1 is written from another (a second only then)
        pending: tuple[FrameHeader, torch.Tensor] | None = None  # received, not yet answered
        replies = _Replies(link)
        try:
            while not self._closed:
                header = link.recv_header(time.monotonic() + IDLE_SECONDS)
                if header.msg_type is MsgType.FRAME:
                    payload = self._receive_frame(replies, header, staging, pending)
                    if link.window > 1:
                        pending = (header, payload)  # answered while the next one arrives
                    else:
                        self._answer(replies, header, payload)
                    continue
                if pending is not None:
                    self._answer(replies, *pending)
                    pending = None
                reply = self._handle(link, header, begun)
                if reply is not None:
                    replies.send(*reply)
        except TransferError as exc:
            self.core.fail_ids(begun, PeerError(f"sender link lost: {exc}"))

    def _receive_frame(
        self,
        replies: _Replies,
        header: FrameHeader,
        staging: list[torch.Tensor],
        pending: tuple[FrameHeader, torch.Tensor] | None,
    ) -> torch.Tensor:
        """Receive a FRAME's payload (uint8 [payload_len]) into the staging buffer `pending`
        does not use, answering `pending` while the bytes arrive."""
        link = replies.link
        if header.payload_len > link.max_frame:  # cannot skip it: the link is out of step
            raise FrameError("payload_len", f"{header.payload_len} above {link.max_frame}")
        busy = None if pending is None else pending[1].data_ptr()
        free = next((b for b in staging if b.data_ptr() != busy), None)
        if free is None:
            free = torch.empty(link.max_frame, dtype=torch.uint8, device=link.device)
            staging.append(free)
        into = free[: header.payload_len]
        work = link.post_recv_payload(into) if header.payload_len else None
        if pending is not None:
            self._answer(replies, *pending)
        if work is not None:
            link.finish_recv_payload(work, time.monotonic() + REPLY_SECONDS)
        return into

    def _answer(self, replies: _Replies, header: FrameHeader, payload: torch.Tensor) -> None:
        """Check and scatter one received FRAME, then answer it (FRAME_ACK or ERROR)."""
        try:
            self.core.on_frame(header, payload)
        except TransferError as exc:
            replies.send(*_error_reply(replies.link, header, exc))
            return
        replies.send(frame_header(MsgType.FRAME_ACK, header.transfer_id, header.epoch), None)

    def _handle(
        self, link: Link, header: FrameHeader, begun: set[tuple[bytes, int]]
    ) -> tuple[FrameHeader, torch.Tensor | None] | None:
        """Read a control message's payload (keeps the stream in step), then apply it."""
        deadline = time.monotonic() + REPLY_SECONDS
        kind, tid, epoch = header.msg_type, header.transfer_id, header.epoch
        data = _control_payload(header, link, deadline)
        try:
            if kind is MsgType.BEGIN:
                self.core.on_begin(header, data)
                begun.add((tid, epoch))
                return frame_header(MsgType.ACCEPT, tid, epoch), None
            if kind is MsgType.END:
                begun.discard((tid, epoch))
                self.core.on_end(header, data)
                return frame_header(MsgType.DONE, tid, epoch), None
            if kind is MsgType.CANCEL:
                begun.discard((tid, epoch))
                with contextlib.suppress(TransferError):
                    self.core.on_cancel(header)
                return None
            raise FrameError("msg_type", f"unexpected {kind.name}")
        except TransferError as exc:
            return _error_reply(link, header, exc)


def _parse_hello(hello: bytes) -> tuple[bytes, dict[str, Any]] | None:
    """A HELLO's layout bytes and its extras (the JSON object after the NUL); None when the
    extras are not a JSON object, nested too deep included (such a HELLO is dropped
    unanswered). The layout is parsed by the handshake: a valid one that does not match is
    answered with the receiver's own layout, one that cannot be parsed is not answered."""
    layout, _, raw = hello.partition(b"\0")
    try:
        extras = json.loads(raw or b"{}")
    except (ValueError, RecursionError):
        return None
    return (layout, extras) if isinstance(extras, dict) else None


def _await_collected(client: Any, key: str, deadline: float) -> None:
    """Wait until the sender deleted `key` (it does once it read it), at most until
    `deadline`, or until the store fails."""
    pause = 0.005
    with contextlib.suppress(Exception):
        while client.check([key]) and time.monotonic() < deadline:
            time.sleep(pause)
            pause = min(pause * 2, 0.1)


class _Replies:
    """A receiver's answers on one link, in order. An answer's sends are finished only before
    the next answer goes out: a gloo send completes once the sender posts the receive, and
    the sender reads an ERROR's payload only when it collects that answer, which may come
    after its own next message (a CANCEL, or the next part of a streamed transfer)."""

    def __init__(self, link: Link) -> None:
        self.link = link
        self._unfinished: list[Any] = []
        self._body: torch.Tensor | None = None  # kept alive until its send finished

    def send(self, header: FrameHeader, body: torch.Tensor | None) -> None:
        self.link.finish(self._unfinished, time.monotonic() + REPLY_SECONDS)
        self._unfinished, self._body = self.link.post(header, body), body


def _error_reply(
    link: Link, header: FrameHeader, exc: TransferError
) -> tuple[FrameHeader, torch.Tensor]:
    wire = error_to_wire(exc)
    body = torch.frombuffer(bytearray(wire), dtype=torch.uint8).to(link.device)
    return frame_header(MsgType.ERROR, header.transfer_id, header.epoch, wire), body


class _InFlight:
    """A sender's messages sent and not yet answered, oldest first. Only the oldest one's
    answer receive is posted: an ERROR answer's payload must be read before the next answer's
    header is (gloo matches receives to messages in order)."""

    def __init__(self, link: Link) -> None:
        self.link = link
        self._queue: collections.deque[tuple[list[Any], MsgType]] = collections.deque()
        self._answer: HeaderRecv | None = None

    def __len__(self) -> int:
        return len(self._queue)

    def post(self, header: FrameHeader, body: torch.Tensor | None, want: MsgType) -> None:
        """Start sending one message, whose answer must be `want`."""
        self._queue.append((self.link.post(header, body), want))
        if self._answer is None:
            self._answer = self.link.post_recv_header()

    def answer(self, deadline: float) -> None:
        """Wait for the oldest message's answer; ERROR raises the peer's error. Anything else
        that goes wrong (a failed wait, an unreadable answer, another kind than the one wanted)
        leaves the link out of step: it is broken."""
        sends, want = self._queue.popleft()
        answer, self._answer = self._answer, None
        try:
            if answer is None:
                raise PeerError("no answer receive was posted")
            self.link.finish(sends, deadline)
            header = self.link.finish_recv_header(answer, deadline)
            error = None
            if header.msg_type is MsgType.ERROR:
                error = _control_payload(header, self.link, deadline)
            elif header.msg_type is not want:
                raise PeerError(f"expected {want.name}, got {header.msg_type.name}")
            if self._queue:
                self._answer = self.link.post_recv_header()
        except Exception as exc:
            self.link.broken = True
            if isinstance(exc, TransferError):
                raise
            raise PeerError(f"unreadable answer: {str(exc)[:300]}") from None
        if error is not None:
            raise parse_wire_error(error)


class Sender(KVSender):
    def __init__(
        self,
        store: BlockStore,
        address: str,
        *,
        frame_bytes: int = FRAME_BYTES,
        checksum: bool | None = None,
        security: Security | None = None,
        connect_deadline: float | None = None,
    ) -> None:
        """With `security`'s cluster token, HELLOs are signed and only a receiver whose answer
        proves the token is linked with (else `AuthenticationError`); TLS does not apply. A new
        link is built by `connect_deadline` (monotonic), at most HANDSHAKE_SECONDS."""
        super().__init__(store, frame_bytes)
        self.address = address
        self._token = security.token if security is not None else None
        self.device = store.cache.device
        # Host payloads may cross hosts: always hashed. Device (NCCL) payloads are not hashed.
        if checksum is False and self.device.type == "cpu":
            raise FrameError("checksum", "payload checksums are always on for host tensors")
        self.checksum = self.device.type == "cpu" if checksum is None else checksum
        self._max_frame = self.max_frame_bytes
        self._staging: list[torch.Tensor] = []  # uint8 [max_frame] each, made when first needed
        self._close_lock = threading.Lock()
        self._closed = False  # guarded by _close_lock: a closed sender takes no new link
        self._link: Link | None = self._take(connect_deadline)

    @property
    def stale(self) -> bool:
        """Never blocks. True when this idle sender has no link it could use: closed, its link
        broken, or the receiver its link was built with has stopped (a receiver restarted at
        the same address is a new peer)."""
        link = self._link
        return link is None or link.gone

    def close(self) -> None:
        """Idempotent and thread-safe. The link goes back to the pool only when no transfer of
        this sender is still running on it; otherwise its state is unknown and it is aborted."""
        with self._close_lock:
            link, self._link = self._link, None
            self._closed = True
        if link is None:
            return
        if self._active:
            link.abort()
        else:
            POOL.give(self.address, self.layout, link, self._token)

    def _take(self, deadline: float | None = None) -> Link:
        """An idle pooled link to the receiver, or a new one (built until `deadline`)."""
        return POOL.take(
            self.address, self.layout, self.device, self._max_frame, deadline, self._token
        )

    def _transfer(self, plan: SendPlan, record: TransferRecord, waiter: Waiter) -> None:
        link, inflight = self._open_link(plan, waiter)
        try:
            self._run(inflight, plan, waiter)
        except TransferError:
            self._drop_broken(link)
            raise

    def _open_link(self, plan: SendPlan, waiter: Waiter) -> tuple[Link, _InFlight]:
        """A link on which the receiver accepted BEGIN, and its messages in flight.

        A link built before this transfer began may reach a receiver that has stopped since
        (restarted at the same address). When its BEGIN cannot be sent or its answer cannot be
        read (a PeerError that breaks the link: not the receiver's refusal, not the deadline),
        the link is aborted, the pool forgets the store client and idle links it was built
        with, and BEGIN goes once more over a new link, within the transfer's deadline. No
        retry can duplicate a write: nothing but BEGIN went out on the old link, and no block
        is written before ACCEPT. A live receiver that did accept the first BEGIN refuses the
        second (its transfer is no longer pending), so the transfer fails instead."""
        began = time.monotonic()
        link = self._ready_link(waiter.deadline)
        try:
            return link, self._begin(link, plan, waiter)
        except TransferError as exc:
            again = isinstance(exc, PeerError) and link.broken and link.born < began
            again = again and not self._closed  # close() broke it: the receiver is fine
            self._drop_broken(link)
            if not again:
                raise
            POOL.forget(self.address, link.rendezvous)
            waiter.check()
        link = self._adopt(
            POOL.connect(
                self.address,
                self.layout,
                self.device,
                self._max_frame,
                waiter.deadline,
                self._token,
            )
        )
        try:
            return link, self._begin(link, plan, waiter)
        except TransferError:
            self._drop_broken(link)
            raise

    def _ready_link(self, deadline: float) -> Link:
        """This sender's link, replaced first (from the pool, or built until `deadline`) when
        it is broken, its receiver is gone, or it was idle for half the receiver's limit."""
        link = self._link
        if link is None or link.gone or time.monotonic() - link.last_used > IDLE_SECONDS / 2:
            if link is not None:
                link.abort()
            self._link = None
            link = self._adopt(self._take(deadline))
        return link

    def _adopt(self, link: Link) -> Link:
        """Make `link` (just taken or built: nothing sent on it yet) this sender's link,
        unless the sender was closed: then the link goes back to the pool (close() has run, so
        nothing else would give it back) and the transfer fails with PeerError."""
        with self._close_lock:
            if not self._closed:
                self._link = link
                return link
        POOL.give(self.address, self.layout, link, self._token)
        raise PeerError("sender closed")

    def _drop_broken(self, link: Link) -> None:
        """Abort `link` when it is broken (out of step, or its peer gone): never reused."""
        if link.broken:
            link.abort()
            if self._link is link:
                self._link = None

    def _begin(self, link: Link, plan: SendPlan, waiter: Waiter) -> _InFlight:
        """Send BEGIN and wait for ACCEPT (an ERROR answer raises the receiver's error)."""
        tid, epoch = plan.request.transfer_id, plan.request.epoch
        begin = plan.begin_payload()
        body = torch.frombuffer(bytearray(begin), dtype=torch.uint8).to(self.device)
        inflight = _InFlight(link)
        inflight.post(frame_header(MsgType.BEGIN, tid, epoch, begin), body, MsgType.ACCEPT)
        inflight.answer(waiter.deadline)
        return inflight

    def _run(self, inflight: _InFlight, plan: SendPlan, waiter: Waiter) -> None:
        """After ACCEPT: the frames (up to `window` in flight), then END, until DONE."""
        link = inflight.link
        ended = False
        try:
            for index in plan.iter_frames(waiter):
                header, payload = self._frame(plan, index, link.window + 1)  # while others travel
                while len(inflight) >= link.window:
                    inflight.answer(waiter.deadline)
                waiter.check()
                inflight.post(header, payload, MsgType.FRAME_ACK)
            waiter.check()
            end, trailer = plan.end_frame()
            tail = None
            if trailer:
                tail = torch.frombuffer(bytearray(trailer), dtype=torch.uint8).to(self.device)
            inflight.post(end, tail, MsgType.DONE)
            ended = True
            while inflight:
                inflight.answer(waiter.deadline)
        except TransferError:
            if not link.broken:
                _abandon(plan, inflight, cancel=not ended)
            raise

    def _frame(self, plan: SendPlan, index: int, buffers: int) -> tuple[FrameHeader, torch.Tensor]:
        """Frame `index`'s header and payload: the cache's own bytes when its blocks are one
        run (`run_view`), else gathered into one of `buffers` staging buffers in turn (one
        more than the frames in flight, so the one filled is never still being sent)."""
        offset, n = plan.frames[index]
        payload = self.store.run_view(plan.src[offset : offset + n])
        if payload is not None:
            return payload_header(plan, index, payload, self.checksum), payload
        while len(self._staging) < buffers:
            self._staging.append(
                torch.empty(self._max_frame, dtype=torch.uint8, device=self.device)
            )
        return fill_frame(self.store, plan, index, self._staging[index % buffers], self.checksum)


def _abandon(plan: SendPlan, inflight: _InFlight, cancel: bool) -> None:
    """A transfer stopped with messages unanswered: tell the receiver (CANCEL, unless END went
    out) and collect every answer still owed, so the link stays in step for the next transfer;
    a link that cannot be brought back in step within the grace is broken (then aborted)."""
    grace = _grace()
    link = inflight.link
    try:
        if cancel:
            tid, epoch = plan.request.transfer_id, plan.request.epoch
            link.send(frame_header(MsgType.CANCEL, tid, epoch), None, grace)
        while inflight:
            with contextlib.suppress(TransferError):
                inflight.answer(grace)
            if link.broken:
                return
    except TransferError:
        link.broken = True


def _grace() -> float:
    return time.monotonic() + 1.0
