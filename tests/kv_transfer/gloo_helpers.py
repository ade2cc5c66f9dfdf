"""What the gloo tests share: block stores, a plain client of a receiver's `TCPStore` (what
anyone on its network can make), the handshake threads alive, and a bounded poll."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

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


def wait_for(predicate: Callable[[], bool], seconds: float) -> bool:
    """Poll `predicate` for at most `seconds`; its last answer."""
    end = time.monotonic() + seconds
    while not predicate() and time.monotonic() < end:
        time.sleep(0.01)
    return predicate()
