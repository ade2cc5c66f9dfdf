"""Fixtures shared by the service tests."""

from __future__ import annotations

import os
import socket
import tempfile
from collections.abc import Iterator

import pytest


@pytest.fixture
def stalled() -> Iterator[str]:
    """The address of a Unix socket that accepts connections and never answers (a decode
    worker that stalled)."""
    folder = tempfile.mkdtemp(prefix="kvm-stall-")
    path = os.path.join(folder, "stall.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(128)
    yield f"unix:{path}"
    listener.close()
    os.unlink(path)
    os.rmdir(folder)
