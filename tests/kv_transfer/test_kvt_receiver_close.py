"""Closing a KV receiver: everything it built goes (the gRPC receiver's event loop, the shm
receiver's connections, one accepted as it closed included), and a second close returns at
once."""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import torch

from kv_transfer import BlockStore, get_backend
from kv_transfer.errors import PeerError

SHAPE = (8, 1, 2, 4, 2, 8)  # [num_blocks, layers, 2, block_size, heads, head_dim]


def open_descriptors() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_a_closed_grpc_receiver_leaves_no_descriptor_behind() -> None:
    """Each receiver runs its server on an event loop of its own; close() stopped that loop
    but never closed it: its epoll, wake-up pipe and eventfd stayed open, five descriptors
    per receiver a process (a test run, a restarted decode role) ever opened."""
    backend = get_backend("grpc")
    backend.Receiver(BlockStore(torch.zeros(SHAPE))).close()  # grpc's own one-time setup
    before = open_descriptors()
    for _ in range(5):
        backend.Receiver(BlockStore(torch.zeros(SHAPE))).close()
    assert open_descriptors() - before < 5


def test_closing_a_grpc_receiver_twice_returns_at_once() -> None:
    """The second close() asked the stopped loop to stop the server and waited 5 s for an
    answer that could never come."""
    receiver = get_backend("grpc").Receiver(BlockStore(torch.zeros(SHAPE)))
    receiver.close()
    began = time.monotonic()
    receiver.close()
    assert time.monotonic() - began < 1.0


def test_a_connection_accepted_as_the_shm_receiver_closes_is_not_served() -> None:
    """close() shuts down the connections it knows; one accepted just before, not yet
    registered, escaped it: a closed receiver answered its HELLO and kept a thread serving it
    (up to the 10 min idle bound), and the sender, its connection not stale, was pooled."""
    receiver = get_backend("shm").Receiver(BlockStore(torch.zeros(SHAPE)))
    server, accepted = receiver._server, threading.Event()  # type: ignore[attr-defined]
    lock = server._lock

    class LateRegistration:
        """The server's lock, entered late by the accept thread: close() runs meanwhile."""

        def __enter__(self) -> Any:
            if threading.current_thread().name.endswith("-accept"):
                accepted.set()
                time.sleep(0.3)
            return lock.__enter__()

        def __exit__(self, *exc: object) -> Any:
            return lock.__exit__(*exc)

    server._lock = LateRegistration()
    outcome: list[object] = []

    def connect() -> None:
        try:
            store = BlockStore(torch.zeros(SHAPE))
            outcome.append(get_backend("shm").Sender(store, receiver.address, mode="staging"))
        except Exception as exc:
            outcome.append(exc)

    thread = threading.Thread(target=connect)
    thread.start()
    assert accepted.wait(5)
    receiver.close()
    thread.join(15)
    assert len(outcome) == 1 and isinstance(outcome[0], PeerError)
