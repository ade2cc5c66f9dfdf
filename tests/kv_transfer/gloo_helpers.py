"""What the gloo tests share: block stores, a plain client of a receiver's `TCPStore` (what
anyone on its network can make), the handshake threads alive, a bounded poll, and a fixture
that starts each test with no link thread alive."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist

from kv_transfer import BlockStore
from kv_transfer.backends import gloo_link

SHAPE = (16, 2, 2, 4, 2, 8)  # [num_blocks, layers, 2, block_size, heads, head_dim]
CONNECT_SECONDS = 30.0  # a torch TCPStore connect takes 5 s now and then, on loopback too


def store(seed: int, shape: tuple[int, ...] = SHAPE) -> BlockStore:
    gen = torch.Generator().manual_seed(seed)
    return BlockStore(torch.randn(shape, generator=gen).to(torch.bfloat16))


def store_client(address: str) -> Any:
    """A plain client of the store a receiver serves at `address` (`HOST:PORT`)."""
    host, port = gloo_link.split_host_port(address)
    return dist.TCPStore(
        host, port, None, False, gloo_link.td(CONNECT_SECONDS), wait_for_workers=False
    )


def link_threads() -> set[threading.Thread]:
    """The receiver's handshake / link threads alive in this process."""
    return {t for t in threading.enumerate() if t.name == "kv-gloo-link"}


def handshake_threads() -> int:
    return len(link_threads())


@pytest.fixture(autouse=True)
def earlier_links_ended() -> None:
    """Start each test with no receiver link thread alive: one of an earlier test's closed
    receiver may still be ending, and the tests count these threads. Import it into a test
    module to apply it there."""
    assert wait_for(lambda: handshake_threads() == 0, 15), "an earlier test's link threads run on"


def wait_for(predicate: Callable[[], bool], seconds: float) -> bool:
    """Poll `predicate` for at most `seconds`; its last answer."""
    end = time.monotonic() + seconds
    while not predicate() and time.monotonic() < end:
        time.sleep(0.01)
    return predicate()
