"""KV block transfer between processes and hosts: one interface, several backends.

Importing this package is light (no torch); names resolve lazily. Backends:
`get_backend(name)` for a name of `kvmesh.v1.transfer.BACKENDS` returns a module with `Sender`
and `Receiver` classes implementing `kv_transfer.interface.KVSender` / `KVReceiver`.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

from kvmesh.v1.transfer import BACKENDS as BACKEND_NAMES
from kvmesh.v1.transfer import NETWORK_BACKENDS  # receivers take `bind="HOST:PORT"`

_MODULES = {
    "fake": "kv_transfer.backends.fake",
    "shm": "kv_transfer.backends.shm",
    "gloo": "kv_transfer.backends.gloo",
    "grpc": "kv_transfer.backends.grpc_stream",
    "cuda_ipc": "kv_transfer.backends.cuda_ipc",
}
BACKENDS = {name: _MODULES[name] for name in BACKEND_NAMES}  # name -> module, every name
# Backends whose Sender and Receiver take `security=` (cluster token; TLS on grpc only).
AUTHENTICATED_BACKENDS = ("grpc", "gloo")
# Backends whose Receiver takes `max_connection_idle_seconds=` (HTTP/2 connections it closes
# when idle; gloo links keep their own idle limit).
IDLE_LIMITED_BACKENDS = ("grpc",)

_LAZY = {
    "KVLayout": "kv_transfer.layout",
    "BlockStore": "kv_transfer.blocks",
    "KVSender": "kv_transfer.interface",
    "KVReceiver": "kv_transfer.interface",
    "SendHandle": "kv_transfer.interface",
    "ReceiveHandle": "kv_transfer.receiver_core",
    "TransferRequest": "kv_transfer.state",
    "TransferResult": "kv_transfer.state",
    "TransferState": "kv_transfer.state",
    "new_transfer_id": "kv_transfer.header",
}


def get_backend(name: str) -> ModuleType:
    """Import and return backend `name`; unknown names raise `ValueError` listing the choices."""
    module = BACKENDS.get(name)
    if module is None:
        raise ValueError(f"unknown kv_transfer backend {name!r}; choose from {sorted(BACKENDS)}")
    return importlib.import_module(module)


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'kv_transfer' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


def bind_address(host: str, port: int) -> str:
    """`HOST:PORT` for a receiver's `bind` (IPv6 hosts bracketed)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def receiver_ports(backends: list[str], first_port: int) -> dict[str, int]:
    """The port of each network receiver among `backends`: `first_port`, `first_port + 1`, ...
    in `backends` order (0 for every one when `first_port` is 0: free ports)."""
    network = [name for name in backends if name in NETWORK_BACKENDS]
    return {name: first_port + i if first_port else 0 for i, name in enumerate(network)}


__all__ = [
    "BACKENDS",
    "NETWORK_BACKENDS",
    "bind_address",
    "get_backend",
    "receiver_ports",
    *_LAZY,
]
