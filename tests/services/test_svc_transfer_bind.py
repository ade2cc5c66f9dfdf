"""Decode-side KV receivers bind the worker's host and the requested transfer ports."""

from __future__ import annotations

import socket

import pytest
import torch

from decode_svc.reservations import open_receivers
from kv_transfer import BlockStore


def free_ports(n: int) -> int:
    """A first port with n free consecutive ports after it (best effort)."""
    for _ in range(50):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            first = probe.getsockname()[1]
        if first + n < 65536 and all(_free(first + i) for i in range(n)):
            return int(first)
    raise AssertionError("no free port range")


def _free(port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def test_network_receivers_bind_host_and_consecutive_ports() -> None:
    store = BlockStore(torch.zeros(4, 1, 2, 4, 1, 8, dtype=torch.bfloat16))
    first = free_ports(2)
    receivers = open_receivers(store, ["shm", "grpc", "gloo"], "127.0.0.1", first)
    try:
        assert receivers["grpc"].address == f"127.0.0.1:{first}"
        assert receivers["gloo"].address == f"127.0.0.1:{first + 1}"
        assert receivers["shm"].address.startswith("unix:")
        assert len({r.core for r in receivers.values()}) == 1
    finally:
        for receiver in receivers.values():
            receiver.close()
    ephemeral = open_receivers(store, ["grpc", "gloo"], "127.0.0.1")
    try:
        assert all(r.address.startswith("127.0.0.1:") for r in ephemeral.values())
    finally:
        for receiver in ephemeral.values():
            receiver.close()


@pytest.mark.parametrize("busy", ["grpc", "gloo"])
def test_a_busy_chosen_transfer_port_is_an_error_not_a_skipped_backend(busy: str) -> None:
    """A --transfer-port that cannot be bound raises OSError naming the flag (the worker used
    to serve without that receiver, logging a warning) and closes the receivers opened before
    it, so their ports are free again."""
    store = BlockStore(torch.zeros(4, 1, 2, 4, 1, 8, dtype=torch.bfloat16))
    first = free_ports(2)
    busy_port = first + ["grpc", "gloo"].index(busy)
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", busy_port))
        holder.listen()
        with pytest.raises(OSError, match=f"--transfer-port: cannot bind 127.0.0.1:{busy_port}"):
            open_receivers(store, ["shm", "grpc", "gloo"], "127.0.0.1", first)
    assert _free(first) and _free(first + 1)
