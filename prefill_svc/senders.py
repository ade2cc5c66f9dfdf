"""A pool of KV senders per (backend, endpoint): one transfer per sender at a time."""

from __future__ import annotations

import re
import threading
from collections import defaultdict
from concurrent.futures import Future, ThreadPoolExecutor

from kv_transfer import AUTHENTICATED_BACKENDS, get_backend
from kv_transfer.blocks import BlockStore
from kv_transfer.interface import KVSender
from kvmesh.security import Security

MAX_IDLE_PER_PEER = 4
# Threads connecting new senders (handshakes), the pool's own: a peer that accepts and never
# answers holds one until the connecting call's deadline, never a thread other work needs.
CONNECT_THREADS = 32
UNIX_PATH_BYTES = 107  # sun_path holds 108 bytes with the terminating NUL
_HOST = re.compile(r"(?:[A-Za-z0-9_.-]+|\[[0-9A-Fa-f:.]+(?:%[A-Za-z0-9_.-]+)?\])")


def endpoint_problem(backend: str, endpoint: str) -> str | None:
    """Why `endpoint` cannot be an address of `backend`'s receiver (its syntax only), or None:
    shm `unix:PATH`, cuda_ipc `unix:PATH#TOKEN`, grpc and gloo `HOST:PORT`, any other backend
    anything non-empty."""
    if not endpoint:
        return "empty"
    if backend in ("shm", "cuda_ipc"):
        base, sep, token = endpoint.partition("#")
        if backend == "cuda_ipc" and (not sep or not token):
            return f"expected unix:PATH#TOKEN for {backend}, got {endpoint[:80]!r}"
        if not base.startswith("unix:") or (backend == "shm" and sep):
            return f"expected unix:PATH for {backend}, got {endpoint[:80]!r}"
        path = base.removeprefix("unix:")
        if not path or "\0" in path or len(path.encode(errors="replace")) > UNIX_PATH_BYTES:
            return f"not a Unix socket path: {path[:80]!r}"
        return None
    if backend in ("grpc", "gloo"):
        host, sep, port = endpoint.rpartition(":")
        valid_port = port.isascii() and port.isdigit() and 0 < int(port) < 65536
        if not sep or not valid_port or len(host) > 255 or not _HOST.fullmatch(host):
            return f"expected HOST:PORT for {backend}, got {endpoint[:80]!r}"
    return None


def available_backends(names: list[str]) -> list[str]:
    """The backends among `names` whose module imports here."""
    found = []
    for name in names:
        try:
            get_backend(name)
        except (ImportError, ValueError):
            continue
        found.append(name)
    return found


class SenderPool:
    """`acquire` connects (layout handshake) or reuses an idle sender; `release` returns it.
    Senders of authenticated backends present `security`'s cluster token (and TLS)."""

    def __init__(
        self, store: BlockStore, backends: list[str], security: Security | None = None
    ) -> None:
        self.store = store
        self.backends = backends
        self.security = security
        self._idle: dict[tuple[str, str], list[KVSender]] = defaultdict(list)
        self._lock = threading.Lock()
        self._closed = False  # guarded by _lock: a closed pool keeps no sender
        self._connects = ThreadPoolExecutor(CONNECT_THREADS, thread_name_prefix="kv-connect")

    def take_idle(self, backend: str, endpoint: str) -> KVSender | None:
        """An idle sender to `endpoint`, or None (never blocks: safe on the event loop). Idle
        senders whose peer is gone are closed first (`prune`), so none is handed out."""
        self.prune()
        with self._lock:
            idle = self._idle[(backend, endpoint)]
            return idle.pop() if idle else None

    def acquire(self, backend: str, endpoint: str, deadline: float | None = None) -> KVSender:
        """A sender to `endpoint` (blocking: may connect, its handshake ending by `deadline`,
        monotonic, at most the backend's own handshake bound; LayoutMismatchError on
        mismatch)."""
        idle = self.take_idle(backend, endpoint)
        if idle is not None:
            return idle
        options: dict[str, object] = {"connect_deadline": deadline}
        if backend in AUTHENTICATED_BACKENDS:
            options["security"] = self.security
        sender: KVSender = get_backend(backend).Sender(self.store, endpoint, **options)
        return sender

    def connect(self, backend: str, endpoint: str, deadline: float) -> Future[KVSender]:
        """`acquire` on the pool's own connect threads (never blocks). Cancelling the future
        before a thread took it up means it never runs."""
        return self._connects.submit(self.acquire, backend, endpoint, deadline)

    def release(self, backend: str, endpoint: str, sender: KVSender) -> None:
        """Keep `sender` for reuse, or close it: beyond MAX_IDLE_PER_PEER, or once the pool is
        closed (a transfer thread that outlived the pool's close gives its sender back late:
        pooled then, nothing would ever close it)."""
        with self._lock:
            idle = self._idle[(backend, endpoint)]
            if not self._closed and len(idle) < MAX_IDLE_PER_PEER:
                idle.append(sender)
                return
        sender.close()

    def prune(self) -> int:
        """Close idle senders whose peer is gone (a dead decode worker's connections, which
        would otherwise keep its shared cache mapped here); returns how many."""
        with self._lock:
            stale = [(key, s) for key, group in self._idle.items() for s in group if s.stale]
            for key, sender in stale:
                self._idle[key].remove(sender)
        for _, sender in stale:
            sender.close()
        return len(stale)

    def idle(self, backend: str) -> list[KVSender]:
        """The connected senders of `backend` waiting for a transfer (any endpoint)."""
        with self._lock:
            return [s for (name, _), group in self._idle.items() if name == backend for s in group]

    def close(self) -> None:
        """Close the idle senders; a sender released from now on is closed, not kept."""
        with self._lock:
            self._closed = True
            senders = [s for group in self._idle.values() for s in group]
            self._idle.clear()
        self._connects.shutdown(wait=False, cancel_futures=True)  # a running one ends in time
        for sender in senders:
            sender.close()
