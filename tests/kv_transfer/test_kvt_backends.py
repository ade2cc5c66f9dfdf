"""Each CPU backend end to end between two real processes (`kv_transfer.peer`)."""

from __future__ import annotations

import os
import random
import signal
import time
from collections.abc import Iterator

import pytest
from kvt_peers import SPEC, Peer

BACKENDS = ["shm", "grpc", "gloo"]
SLOW = {
    "num_blocks": 4096,
    "layers": 1,
    "block_size": 4,
    "heads": 1,
    "head_dim": 256,
}  # 4 KiB blocks


def tid() -> str:
    return os.urandom(16).hex()


_POOL: dict[tuple[str, str], tuple[Peer, Peer]] = {}


@pytest.fixture(scope="module", autouse=True)
def _close_pool() -> Iterator[None]:
    yield
    for receiver, sender in _POOL.values():
        sender.close()
        receiver.close()
    _POOL.clear()


def peers(backend: str, store: dict, frame: int | None = None) -> tuple[Peer, Peer]:
    """A connected (receiver, sender) pair, reused across tests; rebuilt after a kill."""
    frame = frame or (4096 if store is SLOW else 3000)
    key = (backend, repr(sorted(store.items())) + str(frame))
    pair = _POOL.get(key)
    if pair is None or any(p.proc.poll() is not None for p in pair):
        for p in pair or ():
            p.close()
        receiver, sender = Peer(backend, {**store, "seed": 1}), Peer(backend, {**store, "seed": 2})
        assert sender.call("connect", address=receiver.address, options={"frame_bytes": frame}) == {
            "ok": True
        }
        pair = _POOL[key] = (receiver, sender)
    return pair


@pytest.mark.parametrize("variant", [{"dtype": "bfloat16"}, {"dtype": "float32", "scales": True}])
@pytest.mark.parametrize("backend", BACKENDS)
def test_random_block_sets_arrive_exactly(backend: str, variant: dict) -> None:
    receiver, sender = peers(backend, {**SPEC, **variant})
    rng = random.Random(backend)
    for count in (1, 7, 40):
        moved_exactly(receiver, sender, rng.sample(range(64), count), rng.sample(range(64), count))


def moved_exactly(receiver: Peer, sender: Peer, src: list[int], dst: list[int]) -> None:
    """Transfer `src` into `dst`; the destination then holds exactly the source's bytes."""
    t, before = tid(), receiver.call("digest", ids=dst)["digest"]
    assert receiver.call("expect", tid=t, epoch=3, dst=dst, seconds=20) == {"ok": True}
    sent = sender.call("send", tid=t, epoch=3, src=src, dst=dst, seconds=20)
    assert sent["state"] == "COMPLETED", sent
    assert receiver.call("wait", tid=t)["state"] == "COMPLETED"
    got = receiver.call("digest", ids=dst)["digest"]
    assert got == sender.call("digest", ids=src)["digest"] != before


RUNS = [
    (list(range(8, 40)), list(range(20, 52))),  # one run on both sides
    (list(range(0, 16)), [5, 9, 2, *range(30, 43)]),  # the destination partly a run
    ([3, 1, *range(40, 54)], list(range(48, 64))),  # the source partly a run
]


@pytest.mark.parametrize("variant", [{"dtype": "bfloat16"}, {"dtype": "float32", "scales": True}])
@pytest.mark.parametrize("backend", BACKENDS)
def test_runs_of_consecutive_blocks_arrive_exactly(backend: str, variant: dict) -> None:
    """Frames of several blocks whose ids are runs (sent from the cache in place where the
    backend can) or not, in one transfer."""
    receiver, sender = peers(backend, {**SPEC, **variant}, frame=5 * 4096)
    for src, dst in RUNS:
        moved_exactly(receiver, sender, src, dst)


@pytest.mark.parametrize("backend", BACKENDS)
def test_stale_epoch_and_unknown_transfer_leave_blocks_untouched(backend: str) -> None:
    receiver, sender = peers(backend, SPEC)
    t, dst = tid(), [10, 11, 12]
    before = receiver.call("digest", ids=dst)["digest"]
    receiver.call("expect", tid=t, epoch=5, dst=dst, seconds=20)
    stale = sender.call("send", tid=t, epoch=4, src=[1, 2, 3], dst=dst, seconds=10)
    unknown = sender.call("send", tid=tid(), epoch=5, src=[1, 2, 3], dst=dst, seconds=10)
    assert (stale["state"], stale["error"]) == ("FAILED", "StaleEpochError")
    assert (unknown["state"], unknown["error"]) == ("FAILED", "UnknownTransferError"), unknown
    assert receiver.call("digest", ids=dst)["digest"] == before
    ok = sender.call("send", tid=t, epoch=5, src=[1, 2, 3], dst=dst, seconds=10)
    assert ok["state"] == "COMPLETED"


def start_slow(receiver: Peer, sender: Peer, seconds: float = 30) -> str:
    """A transfer of 4096 one-block frames (thousands of round trips) that is still running."""
    t = tid()
    ids = list(range(4096))
    receiver.call("expect", tid=t, epoch=1, dst=ids, seconds=seconds)
    sender.call("start", tid=t, epoch=1, src=ids, dst=ids, seconds=seconds)
    return t


@pytest.mark.parametrize(
    ("backend", "side"), [("shm", "receiver"), ("grpc", "sender"), ("gloo", "receiver")]
)
def test_cancel_reaches_an_in_flight_transfer(backend: str, side: str) -> None:
    receiver, sender = peers(backend, SLOW)
    t = start_slow(receiver, sender)
    wait_in_flight(receiver, t)  # the cancel must meet a running transfer, not a pending one
    (sender if side == "sender" else receiver).call("cancel", tid=t)
    assert sender.call("wait", tid=t)["state"] == "CANCELLED"
    assert receiver.call("wait", tid=t)["state"] == "CANCELLED"
    assert_no_segments(receiver, sender)


@pytest.mark.parametrize("backend", BACKENDS)
def test_deadline_expiry_ends_expired_without_leaks(backend: str) -> None:
    """A receiver that stops answering (SIGSTOP) mid-transfer: the sender's deadline ends it
    EXPIRED however fast the backend is, and after SIGCONT the receiver ends too."""
    receiver, sender = peers(backend, SLOW)
    t = start_slow(receiver, sender, seconds=1.0)
    wait_in_flight(receiver, t)
    os.kill(receiver.proc.pid, signal.SIGSTOP)
    try:
        assert sender.call("wait", tid=t)["state"] == "EXPIRED"
    finally:
        os.kill(receiver.proc.pid, signal.SIGCONT)
    assert receiver.call("wait", tid=t)["state"] in ("EXPIRED", "CANCELLED")
    assert_no_segments(receiver, sender)


@pytest.mark.parametrize(
    ("backend", "victim"), [("shm", "sender"), ("grpc", "receiver"), ("gloo", "receiver")]
)
def test_peer_killed_mid_transfer_ends_without_hang(backend: str, victim: str) -> None:
    receiver, sender = peers(backend, SLOW)
    t = start_slow(receiver, sender, seconds=8)
    time.sleep(0.05)
    dead, survivor = (sender, receiver) if victim == "sender" else (receiver, sender)
    os.kill(dead.proc.pid, signal.SIGKILL)
    began = time.monotonic()
    result = survivor.call("wait", tid=t, timeout=20)
    assert result["state"] in ("FAILED", "EXPIRED")
    assert time.monotonic() - began < 9
    assert_no_segments(survivor)


def wait_in_flight(peer: Peer, t: str, timeout: float = 10.0) -> None:
    """Poll the peer until transfer `t` has started there (bounded)."""
    limit = time.monotonic() + timeout
    while (state := peer.call("state", tid=t)["state"]) == "PENDING":
        assert time.monotonic() < limit, f"transfer {t} still PENDING after {timeout} s"
        time.sleep(0.01)
    assert state == "IN_FLIGHT", state


def assert_no_segments(*peers: Peer) -> None:
    """No named segment in /dev/shm and no mapping left, once connections wind down (a killed
    creator's name is removed by its resource tracker shortly after the kill)."""
    limit = time.monotonic() + 5

    def names() -> list[str]:
        shm = "/dev/shm"
        return [n for n in os.listdir(shm) if n.startswith("kvmesh_")] if os.path.isdir(shm) else []

    while names() and time.monotonic() < limit:
        time.sleep(0.05)
    assert names() == []
    for peer in peers:
        while peer.call("maps")["maps"] and time.monotonic() < limit:
            time.sleep(0.05)
        assert peer.call("maps")["maps"] == []
