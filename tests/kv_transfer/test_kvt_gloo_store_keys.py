"""A gloo receiver's `TCPStore` does not grow with the handshakes it served: the keys of a
refused handshake, of one whose sender never joined, and of a link that closed are deleted
(counted with `num_keys` through a plain store client, over loopback)."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest
from gloo_helpers import earlier_links_ended, handshake_threads, store, store_client, wait_for

from kv_transfer import TransferRequest, get_backend, new_transfer_id
from kv_transfer.backends import gloo as gloo_mod
from kv_transfer.backends import gloo_handshake, gloo_link
from kv_transfer.errors import LayoutMismatchError

__all__ = ["earlier_links_ended"]  # an autouse fixture: every test here


def handshakes_done() -> bool:
    return handshake_threads() == 0


@pytest.fixture
def receiver() -> Any:
    opened = get_backend("gloo").Receiver(store(1))
    yield opened
    opened.close()


def test_a_refused_handshake_leaves_no_key(receiver: Any) -> None:
    keys = store_client(receiver.address)
    before = keys.num_keys()
    with pytest.raises(LayoutMismatchError):
        get_backend("gloo").Sender(store(2, (16, 2, 2, 8, 2, 8)), receiver.address)
    assert wait_for(handshakes_done, 5)
    assert keys.num_keys() == before


def test_a_handshake_whose_sender_never_joins_leaves_no_key(
    receiver: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A HELLO answered, then no sender in the group: once the receiver gives up on it, its
    HELLO, its answer and the group's rendezvous keys are gone."""
    monkeypatch.setattr(gloo_mod, "HANDSHAKE_SECONDS", 1.0)
    monkeypatch.setattr(gloo_link, "HANDSHAKE_SECONDS", 1.0)
    keys = store_client(receiver.address)
    before = keys.num_keys()
    hello = receiver.layout.to_bytes() + b"\0" + json.dumps({"max_frame": 1024}).encode()
    keys.set(gloo_handshake.scope("half") + "hello", hello)
    keys.queue_push(gloo_link.QUEUE, "half")
    assert wait_for(lambda: not handshakes_done(), 2)
    assert wait_for(handshakes_done, 10)
    assert keys.num_keys() == before


def test_a_closed_link_leaves_no_key(receiver: Any) -> None:
    """A link's group keys stay while it lives (its HELLO and answer do not) and go with it."""
    keys = store_client(receiver.address)
    before = keys.num_keys()
    src = store(2)
    sender = get_backend("gloo").Sender(src, receiver.address, frame_bytes=1024)
    link = sender._link
    try:
        req = TransferRequest(new_transfer_id(), 1)
        got = receiver.expect(req, [3], time.monotonic() + 10)
        assert sender.send(req, [0], [3], deadline=time.monotonic() + 10).ok
        assert got.wait(5).ok
        assert keys.num_keys() == before + len(gloo_handshake.GROUP_KEYS)
    finally:
        sender.close()
        link.abort()  # pooled, idle: closing it ends the receiver's link thread
    assert wait_for(handshakes_done, 5)
    assert keys.num_keys() == before
