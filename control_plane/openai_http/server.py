"""uvicorn serving the HTTP door on the control plane's own event loop (beside grpc.aio)."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import socket
import ssl
from collections.abc import Iterator
from typing import Any

import h11
import uvicorn
from starlette.types import ASGIApp, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol, RequestResponseCycle

from kvmesh.security import TlsConfig

LOG = logging.getLogger("kvmesh.control_plane.http")
REQUEST_SECONDS = 60.0  # a request's head and body, however they trickle in
_RECEIVED = (h11.DONE, h11.MUST_CLOSE, h11.CLOSED)


class ResponseCut(Exception):
    """Raised by the app to end a response it started, whose client did not take it in time
    (it stopped reading): the connection is dropped at once, its unsent bytes discarded."""


class BoundedH11(H11Protocol):
    """uvicorn's h11 protocol with a bound on receiving a request: from the connection's start
    (or the previous response's end) its head and body must arrive within `request_seconds`,
    else the connection is closed. uvicorn alone waits forever for a head sent a byte at a
    time (its keep-alive timer stops at the first byte), so slow clients could hold every
    file descriptor (slowloris).

    Nor does a connection outlive its bounds waiting for a client that does not read: one
    still closing (its last bytes unsent) when the bound expires again is aborted, and one
    whose response the app left unfinished (`ResponseCut`, or any failure after the response
    started) is aborted at once; uvicorn's close would wait for the client to read them all,
    holding the connection and its buffered bytes with no deadline."""

    request_seconds = REQUEST_SECONDS
    _timer: asyncio.TimerHandle | None = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.app = functools.partial(self._guarded, self.app)

    async def _guarded(self, app: Any, scope: Scope, receive: Receive, send: Send) -> None:
        """Run `app` for one request; a response it left unfinished drops the connection."""
        cycle = self.cycle  # this request's (the next starts only after its response ends)
        try:
            await app(scope, receive, send)
        except ResponseCut as cut:
            LOG.warning("%s: %s; connection dropped", scope.get("path"), cut)
            self._drop(cycle, cut=True)
        except BaseException:
            self._drop(cycle)
            raise
        else:
            self._drop(cycle)

    def _drop(self, cycle: RequestResponseCycle | None, cut: bool = False) -> None:
        """Abort the connection if `cycle`'s response was `cut`, or started and did not end."""
        if cycle is None or cycle.response_complete or not (cut or cycle.response_started):
            return
        self.transport.abort()
        cycle.disconnected = True  # gone: uvicorn neither writes to it nor reports the app

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._timer is not None:
            self._timer.cancel()
        super().connection_lost(exc)

    def _arm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer = self.loop.call_later(self.request_seconds, self._expire)

    def _expire(self) -> None:
        """Close the connection unless the request it waited for has fully arrived, and abort
        it if it is still closing a bound later (its client is not taking its last bytes)."""
        if self.transport.is_closing():
            self.transport.abort()
        elif self.conn.their_state not in _RECEIVED:
            self.transport.close()
            self._arm()


class _EmbeddedServer(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield  # the control plane owns SIGINT/SIGTERM: they drain it, then stop this server


class HttpServer:
    """One uvicorn server on a socket bound at construction (port 0 picks a free one); HTTPS
    when `tls` has a certificate (client certificates required with `public_client_auth`).
    A request's head and body must arrive within `request_seconds` (`BoundedH11`)."""

    def __init__(
        self,
        app: ASGIApp,
        host: str,
        port: int,
        shutdown_seconds: float = 1.0,
        tls: TlsConfig | None = None,
        request_seconds: float = REQUEST_SECONDS,
    ) -> None:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        try:
            self._socket = socket.create_server((host, port), family=family)
        except OSError as error:
            raise OSError(f"http_port: cannot bind {host}:{port}: {error}") from None
        self.host, self.port = host, self._socket.getsockname()[1]
        self._shutdown_seconds = shutdown_seconds
        self.scheme = "https" if tls is not None and tls.cert is not None else "http"
        protocol = type("BoundedH11", (BoundedH11,), {"request_seconds": request_seconds})
        config = uvicorn.Config(
            app, http=protocol, lifespan="off", access_log=False, log_config=None,
            timeout_graceful_shutdown=max(1, round(shutdown_seconds)), **tls_options(tls),
        )  # fmt: skip
        self._server = _EmbeddedServer(config)
        self._task: asyncio.Task[None] | None = None

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{self.scheme}://{host}:{self.port}"

    def start(self) -> None:
        """Serve on the running loop; connections queue on the listening socket meanwhile."""
        self._task = asyncio.create_task(self._server.serve(sockets=[self._socket]))

    async def stop(self) -> None:
        """Stop accepting, close connections; bounded (the task is cancelled past the bound)."""
        task, self._task = self._task, None
        if task is None:
            self._socket.close()
            return
        self._server.should_exit = True
        try:
            await asyncio.wait_for(task, self._shutdown_seconds + 2.0)
        except TimeoutError:
            LOG.warning("http server did not stop within the bound; cancelled")
        except Exception as error:
            LOG.warning("http server ended with %r", error)
        finally:
            self._socket.close()


def tls_options(tls: TlsConfig | None) -> dict[str, Any]:
    """uvicorn's TLS settings for `tls` (none without a certificate)."""
    if tls is None or tls.cert is None:
        return {}
    options: dict[str, Any] = {"ssl_certfile": tls.cert, "ssl_keyfile": tls.key}
    if tls.public_client_auth:
        options.update(ssl_ca_certs=tls.ca, ssl_cert_reqs=ssl.CERT_REQUIRED)
    return options
