"""A Unix-socket accept loop in a private directory, one thread per connection."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import sys
import tempfile
import threading
from collections.abc import Callable

from kv_transfer.control import require_same_user


class UnixServer:
    """Listens on `unix:<private dir>/kv.sock`; only peers with our uid are served."""

    def __init__(self, handler: Callable[[socket.socket], None], name: str) -> None:
        self._dir = tempfile.mkdtemp(prefix="kvmesh-")
        os.chmod(self._dir, 0o700)
        self.path = os.path.join(self._dir, "kv.sock")
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.bind(self.path)
        self._sock.listen(64)
        self._handler = handler
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._closed = False
        threading.Thread(target=self._accept_loop, name=f"{name}-accept", daemon=True).start()

    @property
    def address(self) -> str:
        return f"unix:{self.path}"

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            if not self._register(conn):
                conn.close()
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _register(self, conn: socket.socket) -> bool:
        """Add `conn` to the connections close() shuts down; False once the server is closed:
        close() may have run since accept() returned, its sweep missing this connection (a
        closed server would serve it, a thread kept up to the idle bound)."""
        with self._lock:
            if self._closed:  # close() sets it before its sweep takes the lock
                return False
            self._conns.add(conn)
            return True

    def _serve(self, conn: socket.socket) -> None:
        try:
            require_same_user(conn)
            self._handler(conn)
        except Exception as exc:  # the handler already failed the transfers it had begun
            if os.environ.get("KVMESH_DEBUG_TRANSFER"):
                print(f"kv_transfer connection ended: {exc!r}", file=sys.stderr, flush=True)
        finally:
            with self._lock:
                self._conns.discard(conn)
            conn.close()

    def close(self) -> None:
        self._closed = True
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()
        with self._lock:
            conns = list(self._conns)
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
        shutil.rmtree(self._dir, ignore_errors=True)
