"""A gloo receiver restarted at the same address (a worker with a fixed transfer port): every
transfer after the restart completes and writes the sender's bytes. Links and the store client
built with the stopped receiver are dropped when the pool sees it go (`Sender.stale` turns
true), or, when its death was not seen yet, when BEGIN cannot be sent or answered: the
transfer then builds one new link and sends BEGIN again."""

from __future__ import annotations

import os
import signal
import socket
import time

import pytest
from gloo_helpers import wait_for
from kvt_peers import SPEC, Peer

from kv_transfer import TransferRequest, TransferState, get_backend, new_transfer_id
from kv_transfer.backends import gloo_link
from kv_transfer.blocks import BlockStore
from kv_transfer.interface import KVSender
from kv_transfer.peer import digest, make_store

RECEIVER = {**SPEC, "seed": 1, "shared": False}
FRAME = 2 * 2048  # two blocks of SPEC per frame: a transfer of 4 blocks is 2 frames


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def restart(receiver: Peer, port: int) -> Peer:
    """Kill `receiver` (no goodbye on any connection), then start a new one on its port."""
    os.kill(receiver.proc.pid, signal.SIGKILL)
    receiver.proc.wait(10)
    again = Peer("gloo", RECEIVER, receive=True, receiver_options={"bind": f"127.0.0.1:{port}"})
    assert again.address == receiver.address
    return again


def transfer(sender: KVSender, src: BlockStore, receiver: Peer, dst: list[int]) -> None:
    """Blocks 0.. of `src` into `dst` of `receiver`: COMPLETED at both ends, same bytes."""
    src_ids = list(range(len(dst)))
    tid = new_transfer_id()
    receiver.call("expect", tid=tid.hex(), epoch=1, dst=dst, seconds=10)
    sent = sender.send(TransferRequest(tid, 1), src_ids, dst, deadline=time.monotonic() + 10)
    assert sent.state is TransferState.COMPLETED, (sent.state, sent.error)
    assert receiver.call("wait", tid=tid.hex())["state"] == "COMPLETED"
    assert receiver.call("digest", ids=dst)["digest"] == digest(src, src_ids)


@pytest.mark.parametrize("seen", [True, False], ids=["death-seen", "death-unseen"])
def test_transfers_after_the_receiver_restarts_at_the_same_address_complete(
    seen: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two restarts. After each, a sender whose link predates the restart and a new sender
    (first taking an idle pooled link, then, with larger frames, building one through the kept
    store client) transfer. `seen`: the pool sees the old receiver's connection close;
    otherwise that notice counts as not yet arrived (across hosts it can lag), and BEGIN or
    the handshake finds the dead link or store client."""
    if not seen:
        monkeypatch.setattr(gloo_link.Rendezvous, "gone", property(lambda self: False))
    gloo = get_backend("gloo")
    port = free_port()
    receiver = Peer("gloo", RECEIVER, receive=True, receiver_options={"bind": f"127.0.0.1:{port}"})
    src = make_store({**SPEC, "seed": 2, "shared": False})
    senders = [gloo.Sender(src, receiver.address, frame_bytes=FRAME) for _ in range(3)]
    held = senders[0]
    try:
        transfer(held, src, receiver, [3, 4, 5, 6])
        for idle in senders[1:]:
            idle.close()  # two idle links in the pool, built with this receiver
        receiver = restart(receiver, port)
        assert wait_for(lambda: held.stale, 2.0) is seen
        pooled = gloo.Sender(src, receiver.address, frame_bytes=FRAME)
        senders.append(pooled)
        transfer(pooled, src, receiver, [7, 8, 9, 10])
        transfer(held, src, receiver, [11, 12, 20, 21])
        assert not held.stale
        pooled.close()  # idle again, built with the second receiver
        receiver = restart(receiver, port)
        assert wait_for(lambda: held.stale, 2.0) is seen
        wide = gloo.Sender(src, receiver.address, frame_bytes=2 * FRAME)
        senders.append(wide)
        transfer(wide, src, receiver, [30, 31, 32, 33, 34])
        transfer(held, src, receiver, [40, 41, 42])
        assert not held.stale
    finally:
        for sender in senders:
            sender.close()
        receiver.close()
