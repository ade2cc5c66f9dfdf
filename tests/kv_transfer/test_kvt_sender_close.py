"""Senders close once, even when their owner and a transfer thread close them together; a
closed shm sender stays closed (a transfer started after or racing close() fails with
PeerError and connects nothing)."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import torch

from kv_transfer import BlockStore, TransferRequest, TransferState, get_backend, new_transfer_id
from kv_transfer.errors import PeerError
from kv_transfer.interface import KVSender
from kv_transfer.registered import shared_tensors

SHAPE = (8, 1, 2, 4, 2, 8)  # [num_blocks, layers, 2, block_size, heads, head_dim]


def close_from_two_threads(sender: KVSender) -> list[BaseException]:
    """Both threads call close() released by one barrier; returns what they raised."""
    start = threading.Barrier(3)
    errors: list[BaseException] = []

    def close() -> None:
        start.wait()
        try:
            sender.close()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=close) for _ in range(2)]
    for thread in threads:
        thread.start()
    start.wait()
    for thread in threads:
        thread.join(timeout=10)
    return errors


def test_concurrent_close_is_safe_and_releases_everything() -> None:
    backend = get_backend("shm")
    receiver = backend.Receiver(BlockStore(torch.zeros(SHAPE)))
    try:
        for _ in range(50):
            sender = backend.Sender(BlockStore(torch.randn(SHAPE)), receiver.address)
            assert close_from_two_threads(sender) == []
            assert sender._conn is None and sender._segment is None  # type: ignore[attr-defined]
            sender.close()  # a third close is a no-op
    finally:
        receiver.close()


def test_gloo_sender_concurrent_close_pools_its_link_once() -> None:
    backend = get_backend("gloo")
    receiver = backend.Receiver(BlockStore(torch.zeros(SHAPE)))
    try:
        for _ in range(3):
            sender = backend.Sender(BlockStore(torch.randn(SHAPE)), receiver.address)
            link = sender._link  # type: ignore[attr-defined]
            assert close_from_two_threads(sender) == []
            assert sender._link is None  # type: ignore[attr-defined]
            # Pooled exactly once: the next sender to this address takes that same link.
            again = backend.Sender(BlockStore(torch.randn(SHAPE)), receiver.address)
            third = backend.Sender(BlockStore(torch.randn(SHAPE)), receiver.address)
            assert again._link is link  # type: ignore[attr-defined]
            assert third._link is not link  # type: ignore[attr-defined]
            third.close()
            again.close()
    finally:
        receiver.close()


def _shared_receiver() -> Any:
    cache, _, region = shared_tensors(SHAPE, torch.float32)
    return get_backend("shm").Receiver(BlockStore(cache, region=region))


@pytest.mark.parametrize("mode", ["registered", "staging"])
def test_a_closed_shm_sender_fails_its_transfer_and_does_not_reconnect(mode: str) -> None:
    """A transfer that starts after its sender was closed (its owner gave up on it) fails
    with PeerError: the transfer thread must not connect anew, which left a closed sender
    holding a live connection (and, registered, the receiver's cache mapped) that no owner
    would ever close, and moved blocks after its owner stopped it."""
    receiver = _shared_receiver()
    try:
        sender = get_backend("shm").Sender(
            BlockStore(torch.randn(SHAPE)), receiver.address, mode=mode
        )
        sender.close()
        req = TransferRequest(new_transfer_id(), 1)
        got = receiver.expect(req, [3, 4], time.monotonic() + 10)
        result = sender.start(req, [0, 1], [3, 4], deadline=time.monotonic() + 10).wait(10)
        assert result.state is TransferState.FAILED and isinstance(result.error, PeerError)
        assert sender._conn is None and sender._window is None  # type: ignore[attr-defined]
        assert got.state is TransferState.PENDING  # nothing reached the receiver
    finally:
        receiver.close()


def test_closing_an_shm_sender_while_it_reconnects_keeps_no_connection(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """close() while the transfer thread reconnects (an earlier transfer's abort dropped the
    connection) finds nothing to close; the connection made after it must be dropped by the
    transfer thread itself, and the transfer fail, not run on a closed sender."""
    receiver = _shared_receiver()
    try:
        sender = get_backend("shm").Sender(BlockStore(torch.randn(SHAPE)), receiver.address)
        unknown = TransferRequest(new_transfer_id(), 1)  # refused: the abort drops the connection
        assert not sender.send(unknown, [0], [3], deadline=time.monotonic() + 10).ok
        assert sender._conn is None  # type: ignore[attr-defined]
        handshake, entered = sender._handshake, threading.Event()  # type: ignore[attr-defined]

        def slow_handshake(*args: Any, **kwargs: Any) -> Any:
            entered.set()
            time.sleep(0.3)
            return handshake(*args, **kwargs)

        monkeypatch.setattr(sender, "_handshake", slow_handshake)
        req = TransferRequest(new_transfer_id(), 1)
        receiver.expect(req, [3, 4], time.monotonic() + 10)
        handle = sender.start(req, [0, 1], [3, 4], deadline=time.monotonic() + 10)
        assert entered.wait(5)
        sender.close()
        assert handle.wait(10).state is TransferState.FAILED
        assert sender._conn is None and sender._window is None  # type: ignore[attr-defined]
    finally:
        receiver.close()


@pytest.mark.parametrize(("mode", "hook"), [("registered", "grant"), ("staging", "on_begin")])
def test_closing_an_shm_sender_while_its_begin_awaits_accept_fails_it_as_a_peer_error(
    mode: str, hook: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """close() while the transfer thread waits for ACCEPT: the transfer fails with PeerError
    (its connection is gone), not with whatever the thread tripped on reading a connection
    that close() had set to None (an AttributeError reported as a bare TransferError); the
    receiver sees the connection close and ends the transfer, its window closed."""
    receiver = _shared_receiver()
    try:
        sender = get_backend("shm").Sender(
            BlockStore(torch.randn(SHAPE)), receiver.address, mode=mode
        )
        answer, entered = getattr(receiver.core, hook), threading.Event()

        def slow_answer(*args: Any, **kwargs: Any) -> Any:
            entered.set()
            time.sleep(0.5)
            return answer(*args, **kwargs)

        monkeypatch.setattr(receiver.core, hook, slow_answer)
        req = TransferRequest(new_transfer_id(), 1)
        got = receiver.expect(req, [3, 4], time.monotonic() + 10)
        handle = sender.start(req, [0, 1], [3, 4], deadline=time.monotonic() + 10)
        assert entered.wait(5)  # BEGIN arrived, ACCEPT not sent yet
        time.sleep(0.1)  # the transfer thread is in its wait for ACCEPT
        sender.close()
        result = handle.wait(10)
        assert result.state is TransferState.FAILED and isinstance(result.error, PeerError)
        assert got.wait(5).state is TransferState.FAILED and got.quiet
    finally:
        receiver.close()
