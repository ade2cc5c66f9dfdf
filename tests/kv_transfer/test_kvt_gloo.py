"""gloo backend inside one process: handshake refusals, pooled links, receiver close, runs,
links closed after a transfer was abandoned (no link thread left behind), and two frames in
flight (the window a sender asks for, a refusal mid-window)."""

from __future__ import annotations

import dataclasses
import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from gloo_helpers import (
    SHAPE,
    earlier_links_ended,
    handshake_threads,
    link_threads,
    store,
    store_client,
    wait_for,
)

from kv_transfer import BlockStore, TransferRequest, TransferState, get_backend, new_transfer_id
from kv_transfer.backends import gloo as gloo_mod
from kv_transfer.backends import gloo_handshake, gloo_link
from kv_transfer.errors import ChecksumError, LayoutMismatchError, PeerError
from kv_transfer.header import FrameHeader, MsgType
from kv_transfer.interface import StreamSendHandle
from kv_transfer.receiver_core import ReceiveHandle

__all__ = ["earlier_links_ended"]  # an autouse fixture: every test here


def _one_transfer(
    gloo: Any, receiver: Any, src: BlockStore, src_ids: list[int], dst_ids: list[int]
) -> None:
    """A new sender moves `src_ids` of `src` into `dst_ids` of `receiver`'s store: both sides
    end ok and the blocks arrive exactly."""
    sender = gloo.Sender(src, receiver.address, frame_bytes=1024)
    try:
        req = TransferRequest(new_transfer_id(), 1)
        handle = receiver.expect(req, dst_ids, time.monotonic() + 10)
        assert sender.send(req, src_ids, dst_ids, deadline=time.monotonic() + 10).ok
        assert handle.wait().ok
        assert torch.equal(receiver.store.cache[dst_ids], src.cache[src_ids])
    finally:
        sender.close()


@pytest.fixture(scope="module")
def gloo() -> object:
    return get_backend("gloo")


def test_layout_mismatch_refused_at_handshake(gloo: object) -> None:
    receiver = gloo.Receiver(store(1))  # type: ignore[attr-defined]
    try:
        with pytest.raises(LayoutMismatchError) as info:
            gloo.Sender(store(2, (16, 2, 2, 8, 2, 8)), receiver.address)  # type: ignore[attr-defined]
        assert info.value.field == "block_size"
    finally:
        receiver.close()


def test_links_are_pooled_and_a_closed_receiver_fails_fast(gloo: object) -> None:
    src, dst = store(2), store(1)
    receiver = gloo.Receiver(dst)  # type: ignore[attr-defined]
    first = gloo.Sender(src, receiver.address, frame_bytes=1024)  # type: ignore[attr-defined]
    link = first._link
    first.close()
    second = gloo.Sender(src, receiver.address, frame_bytes=1024)  # type: ignore[attr-defined]
    assert second._link is link  # the process group is reused, not rebuilt
    req = TransferRequest(new_transfer_id(), 1)
    handle = receiver.expect(req, [3, 4, 5], time.monotonic() + 10)
    assert second.send(req, [0, 1, 2], [3, 4, 5], deadline=time.monotonic() + 10).ok
    assert handle.wait().ok and torch.equal(dst.cache[3:6], src.cache[0:3])
    receiver.close()
    began = time.monotonic()
    late = second.send(
        TransferRequest(new_transfer_id(), 1), [0], [3], deadline=time.monotonic() + 5
    )
    assert late.state in (TransferState.FAILED, TransferState.EXPIRED)
    assert time.monotonic() - began < 5
    with pytest.raises(PeerError):
        gloo.Sender(src, receiver.address)  # type: ignore[attr-defined]
    second.close()


def test_run_view_is_the_cache_bytes_of_consecutive_blocks() -> None:
    """What a run of blocks is sent from in place (no staging copy)."""
    s = store(1)
    view = s.run_view(torch.tensor([3, 4, 5]))
    assert view is not None and view.data_ptr() == s.cache[3].data_ptr()
    assert torch.equal(view, s.cache[3:6].reshape(-1).view(torch.uint8))
    assert s.run_view(torch.tensor([3, 5])) is None  # not one run: gathered
    scaled = BlockStore(s.cache.float(), torch.ones(SHAPE[:5]))
    assert scaled.run_view(torch.tensor([3, 4])) is None  # [scales][kv] is two ranges


def begun(receiver: object, sender: object) -> tuple[ReceiveHandle, StreamSendHandle]:
    """A streamed transfer whose BEGIN the receiver accepted, no block sent yet (the producer
    still computes); the reservation's lease and the sender's deadline are far off."""
    req = TransferRequest(new_transfer_id(), 1)
    got = receiver.expect(req, [3, 4, 5], time.monotonic() + 60)  # type: ignore[attr-defined]
    handle = sender.start_stream(req, [3, 4, 5], deadline=time.monotonic() + 60)  # type: ignore[attr-defined]
    assert wait_for(lambda: got.state is TransferState.IN_FLIGHT, 5)
    return got, handle


def test_closing_after_a_transfer_cancelled_after_begin_ends_the_link_thread(
    gloo: object,
) -> None:
    """The transfer is cancelled after BEGIN (both ends CANCELLED, its error kept by the
    handle) and its link pooled: closing the receiver ends the link's thread within 2 s."""
    before = link_threads()
    dst = BlockStore(torch.zeros(SHAPE, dtype=torch.bfloat16))
    receiver = gloo.Receiver(dst)  # type: ignore[attr-defined]
    sender = gloo.Sender(store(2), receiver.address)  # type: ignore[attr-defined]
    got, handle = begun(receiver, sender)
    threads = link_threads() - before
    assert len(threads) == 1
    handle.cancel()
    assert handle.wait(5).state is TransferState.CANCELLED
    assert got.wait(5).state is TransferState.CANCELLED
    sender.close()  # idle: its link goes back to the pool
    receiver.close()
    assert wait_for(lambda: not any(t.is_alive() for t in threads), 2.0)
    assert not dst.cache[3:6].any()


def test_a_sender_closed_after_begin_fails_the_receiver_and_ends_its_thread(
    gloo: object,
) -> None:
    """A sender closed while its transfer waits for blocks aborts its link: the receiver, still
    open, fails that transfer and ends the link's thread within 2 s, not at the lease, though
    the sender's transfer thread still holds the link."""
    before = link_threads()
    dst = BlockStore(torch.zeros(SHAPE, dtype=torch.bfloat16))
    receiver = gloo.Receiver(dst)  # type: ignore[attr-defined]
    sender = gloo.Sender(store(2), receiver.address)  # type: ignore[attr-defined]
    try:
        got, handle = begun(receiver, sender)
        threads = link_threads() - before
        sender.close()
        assert wait_for(lambda: got.state.is_terminal, 2.0)
        assert got.state is TransferState.FAILED
        assert wait_for(lambda: not any(t.is_alive() for t in threads), 2.0)
        handle.cancel()
        assert handle.wait(5).state in (TransferState.CANCELLED, TransferState.FAILED)
        assert not dst.cache[3:6].any()
    finally:
        receiver.close()


def recording_receiver(gloo: object, dst: BlockStore, monkeypatch: pytest.MonkeyPatch) -> tuple:
    """A receiver whose link thread records, in order, the FRAME headers it receives
    ("header", k) and the frames it writes ("write", k)."""
    events: list[tuple[str, int]] = []
    original = gloo_link.Link.recv_header

    def recv_header(link: gloo_link.Link, deadline: float) -> FrameHeader:
        header = original(link, deadline)
        if threading.current_thread().name == "kv-gloo-link" and header.msg_type is MsgType.FRAME:
            events.append(("header", header.frame_index))
        return header

    monkeypatch.setattr(gloo_link.Link, "recv_header", recv_header)
    receiver = gloo.Receiver(dst)  # type: ignore[attr-defined]
    write = receiver.core.on_frame

    def on_frame(header: FrameHeader, payload: torch.Tensor) -> None:
        events.append(("write", header.frame_index))
        write(header, payload)

    monkeypatch.setattr(receiver.core, "on_frame", on_frame)
    return receiver, events


def one_block_frames(gloo: object, src: BlockStore, receiver: object) -> object:
    return gloo.Sender(src, receiver.address, frame_bytes=src.layout.bytes_per_block)  # type: ignore[attr-defined]


@pytest.fixture
def pair(gloo: object) -> Iterator[tuple[BlockStore, BlockStore, Any, Any]]:
    """(source, zeroed destination, receiver, sender sending one block per frame), both
    closed after the test."""
    src, dst = store(2), BlockStore(torch.zeros(SHAPE, dtype=torch.bfloat16))
    receiver: Any = gloo.Receiver(dst)  # type: ignore[attr-defined]
    sender: Any = one_block_frames(gloo, src, receiver)
    yield src, dst, receiver, sender
    sender.close()
    receiver.close()


def cancel_at_frame(receiver: Any, monkeypatch: pytest.MonkeyPatch, index: int) -> list:
    """Make the receiver cancel the reservation appended to the returned list while it
    writes frame `index` (the frame is then refused with an ERROR answer)."""
    write, got = receiver.core.on_frame, list[ReceiveHandle]()

    def on_frame(header: FrameHeader, payload: torch.Tensor) -> None:
        if header.frame_index == index:
            got[0].cancel()
        write(header, payload)

    monkeypatch.setattr(receiver.core, "on_frame", on_frame)
    return got


@pytest.mark.parametrize("window", [2, 1])
def test_frame_k_is_written_while_frame_k_plus_1_arrives(
    gloo: object, monkeypatch: pytest.MonkeyPatch, window: int
) -> None:
    """With two frames in flight the receiver writes frame k only after frame k+1's header
    came (k+1's bytes arrive meanwhile); a sender asking for one frame in flight, as one that
    names no window does, gets each frame written (and answered) before the next is sent.
    Either way every block arrives."""
    monkeypatch.setattr(gloo_link, "WINDOW", window)  # what this sender asks for
    src, dst = store(2), BlockStore(torch.zeros(SHAPE, dtype=torch.bfloat16))
    receiver, events = recording_receiver(gloo, dst, monkeypatch)
    sender = one_block_frames(gloo, src, receiver)
    try:
        assert sender._link.window == window  # type: ignore[attr-defined]
        req = TransferRequest(new_transfer_id(), 1)
        got = receiver.expect(req, [9, 3, 5, 7], time.monotonic() + 10)
        assert sender.send(req, [0, 1, 2, 3], [9, 3, 5, 7], deadline=time.monotonic() + 10).ok  # type: ignore[attr-defined]
        assert got.wait(5).ok
        assert torch.equal(dst.cache[[9, 3, 5, 7]], src.cache[0:4])
        order = [events.index(("write", k)) > events.index(("header", k + 1)) for k in range(3)]
        assert order == [window == 2] * 3, events
    finally:
        sender.close()  # type: ignore[attr-defined]
        receiver.close()


def test_a_frame_refused_while_the_next_is_in_flight_leaves_the_link_in_step(
    pair: tuple[Any, ...], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The receiver cancels while writing frame 2 with frame 3 in flight: the sender ends
    with the receiver's reason, collects the answer still owed, and its next transfer runs on
    the same pooled link."""
    src, dst, receiver, sender = pair
    link = sender._link
    assert link.window == 2
    got = cancel_at_frame(receiver, monkeypatch, 2)
    req = TransferRequest(new_transfer_id(), 1)
    got.append(receiver.expect(req, [8, 9, 10, 11, 12], time.monotonic() + 10))
    result = sender.send(req, [0, 1, 2, 3, 4], [8, 9, 10, 11, 12], deadline=time.monotonic() + 10)
    assert result.state in (TransferState.CANCELLED, TransferState.FAILED)
    assert got[0].wait(5).state is TransferState.CANCELLED
    assert not dst.cache[10:13].any()  # nothing written after the cancel
    req = TransferRequest(new_transfer_id(), 1)
    again = receiver.expect(req, [1, 2, 3], time.monotonic() + 10)
    assert sender.send(req, [5, 6, 7], [1, 2, 3], deadline=time.monotonic() + 10).ok
    assert again.wait(5).ok and torch.equal(dst.cache[1:4], src.cache[5:8])
    assert sender._link is link and not link.broken


def test_the_window_is_agreed_per_device() -> None:
    """Two frames in flight on host links whose sender asked for them; one for a sender naming
    none (or nonsense), and always one on CUDA links (NCCL runs a pair's operations in the
    order posted, so an answer posted before the next frame would wait for itself)."""
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert gloo_link.window_for(cpu) == 2 and gloo_link.window_for(cuda) == 1
    assert [gloo_link.agreed_window(w, cpu) for w in (None, "2", 0, 1, 2, 5)] == [1, 1, 1, 1, 2, 2]
    assert gloo_link.agreed_window(2, cuda) == 1


def test_a_refusal_while_a_streamed_sender_waits_does_not_stall_its_cancel(
    pair: tuple[Any, ...], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Frames 0 and 1 in flight, the producer still computing: the receiver cancels while
    writing frame 0 (its ERROR answer waits for the sender to read it), then the sender
    cancels. Both end at once, and the sender's next transfer runs on the same link."""
    _, _, receiver, sender = pair
    link = sender._link
    got = cancel_at_frame(receiver, monkeypatch, 0)
    req = TransferRequest(new_transfer_id(), 1)
    got.append(receiver.expect(req, [3, 4, 5, 6], time.monotonic() + 60))
    handle = sender.start_stream(req, [3, 4, 5, 6], deadline=time.monotonic() + 60)
    handle.add(0, [0, 1])
    assert wait_for(lambda: got[0].state is TransferState.CANCELLED, 5)
    began = time.monotonic()
    handle.cancel()
    assert handle.wait(5).state is TransferState.CANCELLED
    assert time.monotonic() - began < 0.9  # not the 1 s grace
    assert sender._link is link and not link.broken
    req = TransferRequest(new_transfer_id(), 1)
    again = receiver.expect(req, [10, 11], time.monotonic() + 10)
    assert sender.send(req, [0, 1], [10, 11], deadline=time.monotonic() + 10).ok
    assert again.wait(5).ok


def test_an_unreadable_answer_breaks_the_link_and_the_next_transfer_gets_a_new_one(
    pair: tuple[Any, ...], monkeypatch: pytest.MonkeyPatch
) -> None:
    """An ERROR answer (BEGIN names blocks the receiver did not reserve) whose payload fails
    its checksum leaves the link out of step: the transfer fails with that reason, the link is
    broken, and the next transfer runs on a fresh one."""
    _, _, receiver, sender = pair
    link = sender._link
    reply = gloo_mod._error_reply

    def corrupted(*args: object) -> tuple[FrameHeader, torch.Tensor]:
        header, body = reply(*args)  # type: ignore[arg-type]
        return dataclasses.replace(header, checksum=header.checksum ^ 1), body

    monkeypatch.setattr(gloo_mod, "_error_reply", corrupted)
    req = TransferRequest(new_transfer_id(), 1)
    receiver.expect(req, [8, 9], time.monotonic() + 10)
    bad = sender.send(req, [0, 1], [8, 10], deadline=time.monotonic() + 10)
    assert bad.state is TransferState.FAILED and isinstance(bad.error, ChecksumError)
    assert link.broken
    monkeypatch.setattr(gloo_mod, "_error_reply", reply)
    req = TransferRequest(new_transfer_id(), 1)
    again = receiver.expect(req, [1, 2], time.monotonic() + 10)
    assert sender.send(req, [5, 6], [1, 2], deadline=time.monotonic() + 10).ok
    assert again.wait(5).ok and sender._link is not link


def test_a_strangers_close_message_does_not_stop_the_receiver(gloo: object) -> None:
    """The receiver's store is reachable by anyone on its network: a stranger pushing the
    receiver's own close message into the HELLO queue must not stop it accepting links."""
    src, dst = store(2), store(1)
    receiver = gloo.Receiver(dst)  # type: ignore[attr-defined]
    try:
        stranger = store_client(receiver.address)
        stranger.queue_push(gloo_link.QUEUE, gloo_mod._CLOSE)
        time.sleep(0.2)  # the accept loop pops it first
        _one_transfer(gloo, receiver, src, [0], [3])
    finally:
        receiver.close()


def test_link_ids_pushed_by_anyone_do_not_pile_up_threads(gloo: object) -> None:
    """The receiver's store is unauthenticated: ids queued without a HELLO start no thread,
    and a real sender is served after them."""
    src, dst = store(2), store(1)
    receiver = gloo.Receiver(dst)  # type: ignore[attr-defined]
    rogue = store_client(receiver.address)
    try:
        before = threading.active_count()
        for k in range(200):  # no HELLO: dropped at once
            rogue.queue_push(gloo_link.QUEUE, f"rogue-{k}")
        time.sleep(1.0)
        assert threading.active_count() - before <= gloo_mod.MAX_PENDING_LINKS
        _one_transfer(gloo, receiver, src, [0, 1], [3, 4])
    finally:
        receiver.close()


def test_hellos_whose_extras_are_not_an_object_ask_for_no_slot(
    gloo: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A HELLO whose extras are not a JSON object (an array, not JSON, a string, nested too
    deep for the parser) is dropped when it is read: it asks for no handshake slot, gets no
    answer and leaves no key, and the receiver accepts on. One with empty extras (`{}`) is
    still answered; a real sender is served after them all."""
    asked: list[float] = []
    take_slot = gloo_mod.Receiver._take_slot

    def counted(self: Any, deadline: float) -> bool:
        asked.append(deadline)
        return take_slot(self, deadline)

    monkeypatch.setattr(gloo_mod.Receiver, "_take_slot", counted)
    src, dst = store(2), store(1)
    receiver = gloo.Receiver(dst)  # type: ignore[attr-defined]
    rogue = store_client(receiver.address)
    layout = receiver.layout.to_bytes()
    scope = gloo_handshake.scope
    try:
        before = rogue.num_keys()
        for k, extras in enumerate([b"[1, 2]", b"not json", b'"text"', b"[" * 5000] * 5):
            rogue.set(scope(f"bad-{k}") + "hello", layout + b"\0" + extras)
            rogue.queue_push(gloo_link.QUEUE, f"bad-{k}")
        rogue.set(scope("empty") + "hello", layout + b"\0")
        rogue.queue_push(gloo_link.QUEUE, "empty")  # read after every bad one (queue order)
        assert wait_for(lambda: rogue.check([scope("empty") + "ack"]), 10)
        assert len(asked) == 1 and not any(
            rogue.check([scope(f"bad-{k}") + "ack"]) for k in range(20)
        )
        rogue.delete_key(scope("empty") + "ack")  # collected: that handshake ends
        assert wait_for(lambda: rogue.num_keys() == before, 10)
        _one_transfer(gloo, receiver, src, [0], [3])
    finally:
        receiver.close()


def _half_open(receiver: Any, count: int) -> Any:
    """Queue `count` valid HELLOs whose sender never joins the group; the store client."""
    rogue = store_client(receiver.address)
    hello = receiver.layout.to_bytes() + b"\0" + json.dumps({"max_frame": 1024}).encode()
    for k in range(count):
        rogue.set(f"kvmesh/link/half-{k}/hello", hello)
        rogue.queue_push(gloo_link.QUEUE, f"half-{k}")
    return rogue


def test_a_handshake_whose_sender_never_joins_blocks_no_other(gloo: object) -> None:
    """Each handshake has its own store client: HELLOs never followed through (each waits
    HANDSHAKE_SECONDS for its peer) do not hold up a real sender's handshake, and closing the
    receiver while they wait ends them (a group still being built at exit aborts the process)."""
    src, dst = store(2), store(1)
    receiver = gloo.Receiver(dst)  # type: ignore[attr-defined]
    try:
        rogue = _half_open(receiver, 3)
        deadline = time.monotonic() + 5
        while handshake_threads() < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert handshake_threads() == 3  # all three wait for their peer
        _one_transfer(gloo, receiver, src, [0], [3])
        del rogue
    finally:
        receiver.close()
    assert handshake_threads() == 0


def test_handshakes_under_way_are_bounded(gloo: object, monkeypatch: pytest.MonkeyPatch) -> None:
    """At most MAX_PENDING_LINKS handshakes run at once; further HELLOs wait for a slot (at
    most HANDSHAKE_SECONDS) instead of starting threads, and a real sender is served once the
    stalled ones time out."""
    monkeypatch.setattr(gloo_mod, "MAX_PENDING_LINKS", 2)
    monkeypatch.setattr(gloo_mod, "HANDSHAKE_SECONDS", 1.0)
    monkeypatch.setattr(gloo_link, "HANDSHAKE_SECONDS", 1.0)
    src, dst = store(2), store(1)
    receiver = gloo.Receiver(dst)  # type: ignore[attr-defined]
    try:
        rogue = _half_open(receiver, 5)
        # a torch TCPStore connect takes 5 s now and then: the accept loop's clients may
        # connect late, so wait for the first two handshakes before sampling
        assert wait_for(lambda: handshake_threads() == 2, 20)
        most, end = 2, time.monotonic() + 2.5  # each times out after 1 s; the next ones follow
        while time.monotonic() < end:
            most = max(most, handshake_threads())
            time.sleep(0.005)
        assert most == 2
        deadline = time.monotonic() + 10
        while handshake_threads() and time.monotonic() < deadline:
            time.sleep(0.05)
        monkeypatch.setattr(gloo_link, "HANDSHAKE_SECONDS", 10.0)
        _one_transfer(gloo, receiver, src, [1], [5])
        del rogue
    finally:
        receiver.close()


def test_a_handshake_through_a_kept_store_client_of_a_stopped_receiver_keeps_its_deadline(
    gloo: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The pool keeps a store client per receiver; a handshake makes its own client to the
    same address. When that receiver has stopped and its close was not seen yet (across hosts
    it can lag), that client's connect is refused: the handshake must give up on it at once
    (PeerError, the next transfer builds anew) or at its deadline, not retry the connect for
    the store's whole timeout (HANDSHAKE_SECONDS) past the caller's deadline."""
    monkeypatch.setattr(gloo_link.Rendezvous, "gone", property(lambda self: False))
    src = store(2)
    receiver = gloo.Receiver(store(1))  # type: ignore[attr-defined]
    address = receiver.address
    sender = gloo.Sender(src, address, frame_bytes=1024)  # type: ignore[attr-defined]
    sender.close()  # idle in the pool; its store client is kept
    receiver.close()  # the port now refuses connections
    began = time.monotonic()
    with pytest.raises(PeerError):
        gloo_link.POOL.connect(address, src.layout, src.cache.device, 2048, began + 3)
    assert time.monotonic() - began < 1.5


def test_closing_a_sender_while_its_begin_awaits_accept_touches_no_other_link(
    gloo: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A sender closed while its BEGIN waits for ACCEPT aborts its own link, so the transfer
    fails. That failure is the sender's own doing, not a receiver that stopped: the pool must
    not forget the receiver's store client nor abort the idle links other senders gave back,
    and the closed sender must not build a new link (nobody would ever give it back)."""
    src = store(2)
    receiver = gloo.Receiver(store(1))  # type: ignore[attr-defined]
    senders = [gloo.Sender(src, receiver.address, frame_bytes=1024) for _ in range(3)]  # type: ignore[attr-defined]
    sender, idle = senders[0], [s._link for s in senders[1:]]
    for other in senders[1:]:
        other.close()  # idle in the pool
    begin, entered = receiver.core.on_begin, threading.Event()

    def slow_begin(header: FrameHeader, data: bytes) -> None:
        entered.set()
        time.sleep(0.5)
        begin(header, data)

    monkeypatch.setattr(receiver.core, "on_begin", slow_begin)
    try:
        req = TransferRequest(new_transfer_id(), 1)
        got = receiver.expect(req, [3], time.monotonic() + 10)
        handle = sender.start(req, [0], [3], deadline=time.monotonic() + 10)
        assert entered.wait(5)  # BEGIN arrived, ACCEPT not yet sent
        sender.close()
        assert handle.wait(15).state is TransferState.FAILED
        assert got.wait(5).state is TransferState.FAILED
        assert not any(link.closed for link in idle)
        assert sender._link is None
    finally:
        receiver.close()
