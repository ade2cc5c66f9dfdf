"""The Prometheus exposition server of every kvmesh process (`/metrics` over HTTP).

prometheus_client's `start_http_server` gives each connection a thread with no bound: an idle
or half-open connection (or a client sending a byte at a time) holds its thread forever, so a
stranger reaching the port could pile up threads until the process fails. Here a request's head
must arrive within `read_seconds` of the connection's start, at most `max_connections` are
served at once (one more is closed at once, counted in `MetricsServer.refused`), and a
connection's failure (a timeout, a reset) is not logged as a server error.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app

LOG = logging.getLogger("kvmesh.metrics_http")
READ_SECONDS = 30.0  # for a request to arrive (Prometheus sends it at once)
MAX_CONNECTIONS = 32  # served at once (a scraper holds one)


class _Handler(WSGIRequestHandler):
    """A request whose head has not arrived `timeout` seconds after the connection opened is
    cut (the socket's own timeout bounds each read and write)."""

    timeout = READ_SECONDS  # StreamRequestHandler puts it on the connection's socket

    def handle(self) -> None:
        self._head_bound = threading.Timer(self.timeout, self._cut)
        self._head_bound.daemon = True
        self._head_bound.start()
        try:
            super().handle()
        finally:
            self._head_bound.cancel()

    def parse_request(self) -> bool:
        """Parses the request line and reads the headers: the head is whole once it returns."""
        parsed = bool(super().parse_request())
        self._head_bound.cancel()  # the head arrived in time
        return parsed

    def _cut(self) -> None:
        with contextlib.suppress(OSError):
            self.connection.shutdown(socket.SHUT_RDWR)

    def log_message(self, format: str, *args: Any) -> None:
        """No access log line per scrape."""


class MetricsServer(ThreadingMixIn, WSGIServer):
    """A WSGI server whose connections are bounded in number and in time."""

    daemon_threads = True
    max_connections = MAX_CONNECTIONS

    def server_activate(self) -> None:
        super().server_activate()
        self.refused = 0
        self._slots = threading.BoundedSemaphore(self.max_connections)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            self.refused += 1
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()

    def handle_error(self, request: Any, client_address: Any) -> None:
        LOG.debug("metrics connection from %s ended with an error", client_address, exc_info=True)


def start_metrics_server(
    registry: CollectorRegistry,
    port: int,
    host: str = "127.0.0.1",
    *,
    read_seconds: float = READ_SECONDS,
    max_connections: int = MAX_CONNECTIONS,
) -> MetricsServer:
    """Serve `registry` as Prometheus text on http://host:port/metrics from a daemon thread
    (port 0: a free one, `server.server_port`); `server.shutdown()` then `server_close()`
    stop it. OSError when the address cannot be bound."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    family, _, _, _, sockaddr = infos[0]
    handler = type("Handler", (_Handler,), {"timeout": read_seconds})
    server_class = type(
        "Server", (MetricsServer,), {"address_family": family, "max_connections": max_connections}
    )
    app = make_wsgi_app(registry)
    server: WSGIServer = make_server(str(sockaddr[0]), port, app, server_class, handler)
    assert isinstance(server, MetricsServer)
    threading.Thread(target=server.serve_forever, name="metrics-http", daemon=True).start()
    return server
