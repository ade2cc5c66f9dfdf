"""gloo with the cluster token, over real TCPStores on loopback: a HELLO that does not prove the
token is dropped before it takes a handshake slot and never gets an answer or a group; a sender
refuses an answer that does not prove it (a receiver without the token, or a stranger answering
in the receiver's place); and the services' wiring (`AUTHENTICATED_BACKENDS`) hands the token
to both ends."""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist
from gloo_helpers import (
    CONNECT_SECONDS,
    earlier_links_ended,
    handshake_threads,
    link_threads,
    store,
    store_client,
    wait_for,
)

from decode_svc.reservations import open_receivers
from kv_transfer import BlockStore, TransferRequest, get_backend, new_transfer_id
from kv_transfer.backends import gloo_handshake, gloo_link
from kv_transfer.errors import AuthenticationError, PeerError
from kvmesh.security import Security
from prefill_svc.senders import SenderPool

TOKEN = "gloo-cluster-token-0123456789abcdef"
OTHER = "another-cluster-token-0123456789ab"

__all__ = ["earlier_links_ended"]  # an autouse fixture: every test here


def transfer(sender: Any, receiver: Any, src: BlockStore) -> None:
    """Blocks 0-1 of `src` land in blocks 3-4 of the receiver's store."""
    req = TransferRequest(new_transfer_id(), 1)
    got = receiver.expect(req, [3, 4], time.monotonic() + 10)
    assert sender.send(req, [0, 1], [3, 4], deadline=time.monotonic() + 10).ok
    assert got.wait(5).ok and torch.equal(receiver.store.cache[3:5], src.cache[0:2])


def test_hellos_without_the_token_take_no_slot_and_get_no_answer() -> None:
    """HELLOs with a valid layout but no proof, a proof made with another token, or a proof of
    another link id start no handshake (no thread, no answer, so no group), leave no key
    behind, and a sender holding the token is served at once after them."""
    gloo = get_backend("gloo")
    src, dst = store(2), store(1)
    receiver = gloo.Receiver(dst, security=Security(token=TOKEN))
    rogue = store_client(receiver.address)
    try:
        layout = receiver.layout.to_bytes()
        extras = {"max_frame": 1024, "window": 2}
        forged = {
            "bare": extras,
            "other": gloo_handshake.sign(OTHER, "hello", "other", layout, extras),
            "moved": gloo_handshake.sign(TOKEN, "hello", "elsewhere", layout, extras),
        }
        ids = [f"{kind}-{k}" for kind in forged for k in range(20)]
        for link_id in ids:
            fields = forged[link_id.split("-")[0]]
            hello = layout + b"\0" + json.dumps(fields).encode()
            rogue.set(gloo_handshake.scope(link_id) + "hello", hello)
            rogue.queue_push(gloo_link.QUEUE, link_id)
        most, end = 0, time.monotonic() + 1.0
        while time.monotonic() < end:
            most = max(most, handshake_threads())
            time.sleep(0.005)
        assert most == 0
        acks = [gloo_handshake.scope(link_id) + "ack" for link_id in ids]
        assert not any(rogue.check([key]) for key in acks)
        assert wait_for(lambda: rogue.num_keys() == 0, 5)
        began = time.monotonic()
        sender = gloo.Sender(src, receiver.address, security=Security(token=TOKEN))
        try:
            assert time.monotonic() - began < 2
            transfer(sender, receiver, src)
        finally:
            sender.close()
    finally:
        receiver.close()


def test_a_sender_without_the_token_is_not_served(monkeypatch: pytest.MonkeyPatch) -> None:
    """Its HELLO is dropped unanswered: it gives up at the handshake's end, and the receiver
    started no handshake for it."""
    monkeypatch.setattr(gloo_link, "HANDSHAKE_SECONDS", 1.0)
    gloo = get_backend("gloo")
    receiver = gloo.Receiver(store(1), security=Security(token=TOKEN))
    most, tried = [0], threading.Event()
    before = link_threads()  # an earlier test's link thread may still be ending

    def started() -> int:
        return len(link_threads() - before)

    def sample() -> None:  # while the senders try, not only after they gave up
        while not tried.is_set():
            most[0] = max(most[0], started())
            time.sleep(0.005)

    sampler = threading.Thread(target=sample, daemon=True)
    try:
        sampler.start()
        for security in (None, Security(token=OTHER)):
            with pytest.raises(PeerError):
                gloo.Sender(store(2), receiver.address, security=security)
        tried.set()
        sampler.join(5)
        assert most[0] == 0 and started() == 0
        keys = store_client(receiver.address)
        assert wait_for(lambda: keys.num_keys() == 0, 5)
    finally:
        receiver.close()


def test_a_sender_with_the_token_refuses_a_receiver_without_it() -> None:
    gloo = get_backend("gloo")
    receiver = gloo.Receiver(store(1))
    try:
        with pytest.raises(AuthenticationError):
            gloo.Sender(store(2), receiver.address, security=Security(token=TOKEN))
    finally:
        receiver.close()


def test_a_sender_with_the_token_refuses_a_stranger_answering_for_the_receiver() -> None:
    """A stranger serving the store (or popping the HELLO queue first) answers with the right
    layout and a proof made with another token: the sender refuses it, builds no group."""
    server: Any = dist.TCPStore(  # its clones connect with its timeout
        "127.0.0.1", 0, None, True, gloo_link.td(CONNECT_SECONDS), wait_for_workers=False
    )
    address = f"127.0.0.1:{server.port}"
    src = store(2)
    stop = threading.Event()

    def answer() -> None:
        stranger = server.clone()
        while not stop.is_set():
            try:
                link_id = stranger.queue_pop(gloo_link.QUEUE).decode()
            except Exception:
                continue
            ack = {"layout": src.layout.to_bytes().decode(), "window": 2}
            ack = gloo_handshake.sign(OTHER, "ack", link_id, b"", ack)
            stranger.set(gloo_handshake.scope(link_id) + "ack", json.dumps(ack))

    thread = threading.Thread(target=answer, daemon=True)
    thread.start()
    try:
        with pytest.raises(AuthenticationError):
            get_backend("gloo").Sender(src, address, security=Security(token=TOKEN))
    finally:
        stop.set()
        server.queue_push(gloo_link.QUEUE, "stop")
        thread.join(10)


def test_the_services_wiring_hands_the_token_to_both_ends(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A decode worker's gloo receiver and a prefill worker's gloo senders, made the way the
    services make them from one `Security`: a transfer lands; a prefill worker holding
    another token is not served."""
    src, dst = store(2), store(1)
    security = Security(token=TOKEN)
    receiver = open_receivers(dst, ["gloo"], security=security)["gloo"]
    pool = SenderPool(src, ["gloo"], security)
    stranger = SenderPool(src, ["gloo"], Security(token=OTHER))
    try:
        sender = pool.acquire("gloo", receiver.address)
        transfer(sender, receiver, src)
        pool.release("gloo", receiver.address, sender)
        # only the refused handshake is cut short (a store connect can stall for seconds)
        monkeypatch.setattr(gloo_link, "HANDSHAKE_SECONDS", 1.0)
        with pytest.raises(PeerError):
            stranger.acquire("gloo", receiver.address)
    finally:
        pool.close()
        stranger.close()
        receiver.close()


def test_a_copied_hello_is_taken_once_and_a_stale_one_never() -> None:
    """A HELLO signed with the token is taken once per link id: the same bytes pushed again (a
    copy read from the store) start no second handshake and get no answer; one whose signed
    time lies outside the window is dropped, and so is one signed without a time."""
    gloo = get_backend("gloo")
    receiver = gloo.Receiver(store(1), security=Security(token=TOKEN))
    rogue = store_client(receiver.address)
    layout = receiver.layout.to_bytes()
    extras = {"max_frame": 1024, "window": 2}

    def push(link_id: str, fields: dict[str, Any]) -> None:
        signed = gloo_handshake.sign(TOKEN, "hello", link_id, layout, fields)
        rogue.set(
            gloo_handshake.scope(link_id) + "hello", layout + b"\0" + json.dumps(signed).encode()
        )
        rogue.queue_push(gloo_link.QUEUE, link_id)

    def answered(link_id: str) -> bool:
        return bool(rogue.check([gloo_handshake.scope(link_id) + "ack"]))

    try:
        stale = {**extras, "t": time.time() - 2 * gloo_handshake.REPLAY_SECONDS}
        push("stale", stale)
        push("untimed", extras)
        assert not wait_for(lambda: answered("stale") or answered("untimed"), 1.0)
        assert handshake_threads() == 0
        fresh = gloo_handshake.stamped(extras)
        push("copied", fresh)  # its sender never joins: the handshake waits for it
        assert wait_for(lambda: answered("copied"), 5) and handshake_threads() == 1
        rogue.delete_key(gloo_handshake.scope("copied") + "ack")
        push("copied", fresh)  # the same HELLO again
        assert not wait_for(lambda: answered("copied"), 1.0)
        assert handshake_threads() == 1
        assert not rogue.check([gloo_handshake.scope("copied") + "hello"])  # read and dropped
    finally:
        receiver.close()
