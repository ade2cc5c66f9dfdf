"""Senders close once, even when their owner and a transfer thread close them together."""

from __future__ import annotations

import threading

import torch

from kv_transfer import BlockStore, get_backend
from kv_transfer.interface import KVSender

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
