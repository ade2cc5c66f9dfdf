"""Ports for tests that need one already taken.

Import as `from tests.ports import held_port` (the repository root is on the test path)."""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterator


@contextlib.contextmanager
def held_port() -> Iterator[int]:
    """A loopback port held by a plain listening socket while the context is open."""
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        yield int(holder.getsockname()[1])
