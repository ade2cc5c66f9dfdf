"""A pool of KV senders per (backend, endpoint): one transfer per sender at a time."""

from __future__ import annotations

import threading
from collections import defaultdict

from kv_transfer import AUTHENTICATED_BACKENDS, get_backend
from kv_transfer.blocks import BlockStore
from kv_transfer.interface import KVSender
from kvmesh.security import Security

MAX_IDLE_PER_PEER = 4


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

    def take_idle(self, backend: str, endpoint: str) -> KVSender | None:
        """An idle sender to `endpoint`, or None (never blocks: safe on the event loop). Idle
        senders whose peer is gone are closed first (`prune`), so none is handed out."""
        self.prune()
        with self._lock:
            idle = self._idle[(backend, endpoint)]
            return idle.pop() if idle else None

    def acquire(self, backend: str, endpoint: str) -> KVSender:
        """A sender to `endpoint` (blocking: may connect; LayoutMismatchError on mismatch)."""
        idle = self.take_idle(backend, endpoint)
        if idle is not None:
            return idle
        options = {"security": self.security} if backend in AUTHENTICATED_BACKENDS else {}
        sender: KVSender = get_backend(backend).Sender(self.store, endpoint, **options)
        return sender

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
        for sender in senders:
            sender.close()
