"""What the shm receiver keeps per sender connection, and how a connection ends: a connection
acts only on the transfers it began, under the epoch it began them (a pooled connection outlives
them), forgets each at its END or CANCEL, and a sender that stops reading never holds up the
receiver: a revoke (a cancel on the decode worker's event loop) never waits, and a reply it does
not take in time cuts its connection. Real Unix sockets throughout; the misbehaving senders are
bare sockets of the test's making."""

from __future__ import annotations

import os
import select
import socket
import threading
import time
from typing import Any

import pytest
import torch
from test_kvt_registered import raw_registered, stores, wait_for

from kv_transfer.backends import shm, shm_receiver
from kv_transfer.control import send_msg
from kv_transfer.header import FrameHeader, MsgType, frame_header
from kv_transfer.receiver_core import WINDOW_GRACE_SECONDS
from kv_transfer.state import TransferRequest, TransferState


def begin_raw(conn: socket.socket, tid: bytes, epoch: int, dst: list[int]) -> None:
    payload = torch.tensor(dst, dtype=torch.int32).numpy().tobytes()
    send_msg(conn, frame_header(MsgType.BEGIN, tid, epoch, payload), payload)


def stop_reading(conn: socket.socket, seconds: float = 20.0) -> None:
    """Send messages that each draw an ERROR reply and read none of them, until the receiver
    stops taking ours for 0.5 s (its thread waits inside a reply to us) or cuts us off."""
    # a FRAME without FLAG_IN_PLACE: refused on a registered connection
    refused = FrameHeader(
        MsgType.FRAME, os.urandom(16), 1, frame_index=0, frame_count=1, block_offset=0,
        num_blocks=1, payload_len=0,
    ).encode()  # fmt: skip
    conn.setblocking(False)
    deadline, stalled = time.monotonic() + seconds, None
    while time.monotonic() < deadline:
        try:
            conn.send(refused * 64)
            stalled = None
        except BlockingIOError:
            stalled = stalled or time.monotonic()
            if time.monotonic() - stalled > 0.5:
                return
            time.sleep(0.02)
        except OSError:  # cut off already
            return
    raise AssertionError("the receiver kept reading")


def cut_off(conn: socket.socket, seconds: float = 5.0) -> bool:
    """Whether the receiver closed `conn` within `seconds` (the replies still queued for us are
    read and dropped)."""
    conn.setblocking(False)
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not select.select([conn], [], [], 0.05)[0]:
            continue
        try:
            if not conn.recv(1 << 16):
                return True
        except BlockingIOError:
            continue
        except OSError:
            return True
    return False


def test_a_connection_closing_touches_only_what_it_began_under_its_epoch() -> None:
    """A sender granted transfer T under generation 4 is cancelled (it neither answers the revoke
    nor closes yet), T is reserved again under generation 5 and granted to another sender; then
    the first sender's connection closes. That closes its own window, and generation 5 goes on:
    before, the closing connection failed generation 5 and closed its window, so its blocks
    looked quiet (reusable) while the live sender still wrote into them."""
    receiver_store, sender_store = stores()
    receiver = shm.Receiver(receiver_store)
    live = shm.Sender(sender_store, receiver.address, mode="registered")
    old, fd = raw_registered(receiver.address, receiver_store.layout)
    os.close(fd)
    tid = os.urandom(16)
    try:
        stale = receiver.expect(TransferRequest(tid, 4), [3, 4], time.monotonic() + 30)
        begin_raw(old, tid, 4, [3, 4])
        wait_for(lambda: stale.state is TransferState.IN_FLIGHT)
        assert stale.cancel() and not stale.quiet  # revoked; its sender may still write
        got = receiver.expect(TransferRequest(tid, 5), [5, 6], time.monotonic() + 30)
        sent = live.start_stream(TransferRequest(tid, 5), [5, 6], deadline=time.monotonic() + 30)
        wait_for(lambda: got.state is TransferState.IN_FLIGHT)
        old.close()
        wait_for(lambda: stale.quiet)  # its own window closed with its connection
        assert got.state is TransferState.IN_FLIGHT and not got.quiet
        sent.add(0, [7, 8])
        sent.finish()
        assert sent.wait(5).ok and got.wait(5).ok
        assert torch.equal(receiver_store.cache[[5, 6]], sender_store.cache[[7, 8]])
    finally:
        old.close()
        live.close()
        receiver.close()


@pytest.mark.parametrize("mode", ["registered", "staging"])
def test_a_kept_connection_forgets_the_transfers_it_ended(
    mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A pooled sender's connection carries transfer after transfer: the receiver keeps each
    only until its END (before, every transfer id stayed for the connection's life, which only
    idleness ends). The connection closing afterwards touches a later generation of none."""
    made: list[shm_receiver._Begun] = []

    class Recorded(shm_receiver._Begun):
        def __init__(self, conn: socket.socket) -> None:
            super().__init__(conn)
            made.append(self)

    monkeypatch.setattr(shm_receiver, "_Begun", Recorded)
    receiver_store, sender_store = stores()
    receiver = shm.Receiver(receiver_store)
    sender = shm.Sender(sender_store, receiver.address, mode=mode)
    other = shm.Sender(sender_store, receiver.address, mode=mode)
    try:
        for _ in range(20):
            tid = os.urandom(16)
            got = receiver.expect(TransferRequest(tid, 1), [3], time.monotonic() + 30)
            sent = sender.send(TransferRequest(tid, 1), [1], [3], deadline=time.monotonic() + 30)
            assert sent.ok and got.wait(5).ok
        assert len(made) == 2 and [len(begun) for begun in made] == [0, 0]
        later = receiver.expect(TransferRequest(tid, 2), [5], time.monotonic() + 30)
        stream = other.start_stream(TransferRequest(tid, 2), [5], deadline=time.monotonic() + 30)
        wait_for(lambda: later.state is TransferState.IN_FLIGHT)
        sender.close()
        time.sleep(0.2)  # the receiver read the close by now
        assert later.state is TransferState.IN_FLIGHT
        stream.add(0, [6])
        stream.finish()
        assert stream.wait(5).ok and later.wait(5).ok
    finally:
        sender.close()
        other.close()
        receiver.close()


def granted_then_deaf(receiver: shm.Receiver) -> tuple[socket.socket, Any, float]:
    """A raw registered sender granted a window over blocks 3 and 4 (transfer generation 5)
    that then stops reading its connection: (its socket, the receive handle, the deadline)."""
    conn, fd = raw_registered(receiver.address, receiver.store.layout)
    os.close(fd)
    tid, deadline = os.urandom(16), time.monotonic() + 30
    got = receiver.expect(TransferRequest(tid, 5), [3, 4], deadline)
    begin_raw(conn, tid, 5, [3, 4])  # granted; its ACCEPT is never read
    wait_for(lambda: got.state is TransferState.IN_FLIGHT)
    stop_reading(conn)
    return conn, got, deadline


def test_a_revoke_never_waits_for_a_sender_that_stopped_reading() -> None:
    """A sender holding a window stops reading while its messages keep drawing replies: the
    receiver's thread waits inside a reply to it. Cancelling the transfer (the decode worker
    does it on its event loop) returns at once and cuts the connection (before, it waited for
    that reply, up to the 10 min idle bound); the window stays open, the sender possibly still
    copying, until the lease plus the grace."""
    receiver_store, _ = stores()
    receiver = shm.Receiver(receiver_store)
    conn, got, deadline = granted_then_deaf(receiver)
    try:
        returned = threading.Event()
        threading.Thread(target=lambda: (got.cancel(), returned.set()), daemon=True).start()
        assert returned.wait(2), "cancel() waited on a sender that does not read"
        assert cut_off(conn)
        assert got.state is TransferState.CANCELLED and not got.quiet
        assert got.close_window_if_due(deadline + WINDOW_GRACE_SECONDS + 0.01)
    finally:
        conn.close()
        receiver.close()


def test_a_sender_that_takes_no_replies_is_cut_off(monkeypatch: pytest.MonkeyPatch) -> None:
    """A reply the sender does not take within REPLY_SECONDS cuts its connection (before, the
    receiver's thread waited up to the 10 min idle bound): the transfer it began fails, and its
    window stays open until the lease plus the grace (the sender may still be copying)."""
    monkeypatch.setattr(shm_receiver, "REPLY_SECONDS", 0.5)
    receiver_store, _ = stores()
    receiver = shm.Receiver(receiver_store)
    conn, got, deadline = granted_then_deaf(receiver)
    try:
        wait_for(lambda: got.state is TransferState.FAILED)
        assert cut_off(conn)
        assert not got.quiet
        assert got.close_window_if_due(deadline + WINDOW_GRACE_SECONDS + 0.01)
    finally:
        conn.close()
        receiver.close()
