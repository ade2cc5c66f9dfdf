"""The prefill worker's sender pool: it closes idle senders whose decode worker is gone, and
connects new ones on its own threads, each by its caller's deadline."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch

from kv_transfer.backends import shm
from kv_transfer.blocks import BlockStore
from kv_transfer.errors import TransferError
from kv_transfer.registered import shared_tensors
from prefill_svc import senders
from prefill_svc.senders import SenderPool

SHAPE = (8, 1, 2, 4, 1, 8)


def test_prune_closes_senders_of_a_vanished_receiver() -> None:
    cache, _, region = shared_tensors(SHAPE, torch.float32)
    receiver = shm.Receiver(BlockStore(cache, region=region))
    pool = SenderPool(BlockStore(torch.zeros(SHAPE)), ["shm"])
    try:
        sender = pool.acquire("shm", receiver.address)
        assert isinstance(sender, shm.Sender) and sender.registered  # maps the receiver's cache
        pool.release("shm", receiver.address, sender)
        assert pool.prune() == 0 and pool.idle("shm") == [sender]
        receiver.close()  # the decode worker went away
        limit = time.monotonic() + 5
        while sender.stale is False and time.monotonic() < limit:
            time.sleep(0.01)
        assert pool.prune() == 1 and pool.idle("shm") == []
        assert not sender.registered  # closed: the mapping is dropped with it
    finally:
        pool.close()
        receiver.close()


def test_take_idle_never_hands_out_a_sender_of_a_vanished_receiver() -> None:
    """The fast path (an idle sender, without connecting) closes stale senders too: a dead
    decode worker's cache stays mapped no longer than the next transfer."""
    cache, _, region = shared_tensors(SHAPE, torch.float32)
    receiver = shm.Receiver(BlockStore(cache, region=region))
    pool = SenderPool(BlockStore(torch.zeros(SHAPE)), ["shm"])
    try:
        sender = pool.acquire("shm", receiver.address)
        pool.release("shm", receiver.address, sender)
        receiver.close()
        limit = time.monotonic() + 5
        while sender.stale is False and time.monotonic() < limit:
            time.sleep(0.01)
        assert pool.take_idle("shm", receiver.address) is None
        assert not isinstance(sender, shm.Sender) or not sender.registered  # closed
    finally:
        pool.close()
        receiver.close()


def test_a_sender_given_back_after_the_pool_closed_is_closed() -> None:
    """A prefill worker closing cancels its prefills, then closes the pool; a transfer thread
    still ending gives its sender back later (`_give_back`), after the pool closed. Pooled
    then, nothing would ever close it: its connection, the receiver's connection thread and
    (registered) the mapping of the decode worker's cache lived as long as the process."""
    cache, _, region = shared_tensors(SHAPE, torch.float32)
    receiver = shm.Receiver(BlockStore(cache, region=region))
    pool = SenderPool(BlockStore(torch.zeros(SHAPE)), ["shm"])
    try:
        sender = pool.acquire("shm", receiver.address)
        assert isinstance(sender, shm.Sender) and sender.registered
        pool.close()
        pool.release("shm", receiver.address, sender)
        assert pool.idle("shm") == [] and not sender.registered  # closed, not pooled
    finally:
        pool.close()
        receiver.close()


def test_a_connect_to_a_stalled_receiver_ends_at_its_deadline(stalled: str) -> None:
    """The handshake with a receiver that never answers ends by the caller's deadline, not
    the backend's own (longer) handshake bound."""
    pool = SenderPool(BlockStore(torch.zeros(SHAPE)), ["shm"])
    try:
        start = time.monotonic()
        with pytest.raises(TransferError):
            pool.acquire("shm", stalled, deadline=start + 0.3)
        assert time.monotonic() - start < 2.0
    finally:
        pool.close()


def test_a_connect_cancelled_before_it_started_never_runs(
    stalled: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Connects run on the pool's own threads; one whose call was cancelled while it waited
    for a thread is dropped, never run."""
    monkeypatch.setattr(senders, "CONNECT_THREADS", 1)
    pool = SenderPool(BlockStore(torch.zeros(SHAPE)), ["shm"])
    ran: list[str] = []
    acquire = pool.acquire

    def spy(backend: str, endpoint: str, deadline: float | None = None) -> Any:
        ran.append(endpoint)
        return acquire(backend, endpoint, deadline)

    monkeypatch.setattr(pool, "acquire", spy)
    try:
        busy = pool.connect("shm", stalled, time.monotonic() + 0.5)
        queued = pool.connect("shm", stalled + ".other", time.monotonic() + 0.5)
        assert queued.cancel()
        with pytest.raises(TransferError):
            busy.result(timeout=5)
        time.sleep(0.1)
        assert ran == [stalled]
    finally:
        pool.close()
