"""The metrics port's connections are bounded: an idle or dripping connection is cut after the
read bound, connections beyond the cap are closed at once, and the threads come back; a
scrape still answers."""

from __future__ import annotations

import socket
import threading
import time
import urllib.request
from collections.abc import Iterator

import pytest
from prometheus_client import CollectorRegistry, Counter

from kvmesh.telemetry.metrics_http import MetricsServer, start_metrics_server

READ = 0.5  # seconds: the bound under test


@pytest.fixture
def server() -> Iterator[MetricsServer]:
    registry = CollectorRegistry()
    Counter("probe_events", "A counter to scrape.", registry=registry).inc(3)
    started = start_metrics_server(registry, 0, read_seconds=READ, max_connections=2)
    yield started
    started.shutdown()
    started.server_close()


def connect(server: MetricsServer) -> socket.socket:
    return socket.create_connection(("127.0.0.1", server.server_port), timeout=10)


def closed_after(conn: socket.socket, drip: bytes = b"") -> float:
    """Seconds until the server closes `conn` (sending `drip` a byte every 0.1 s meanwhile)."""
    start = time.monotonic()
    conn.settimeout(0.1)
    for byte in drip:
        try:
            conn.sendall(bytes([byte]))
            if conn.recv(1) == b"":
                break
        except TimeoutError:
            continue
        except OSError:
            break
    else:
        conn.settimeout(10)
        while conn.recv(1024):
            pass
    return time.monotonic() - start


def scrape(server: MetricsServer) -> str:
    url = f"http://127.0.0.1:{server.server_port}/metrics"
    with urllib.request.urlopen(url, timeout=5) as response:
        return str(response.read().decode())


def test_an_idle_or_dripping_connection_is_cut_after_the_read_bound(server: MetricsServer) -> None:
    threads = threading.active_count()
    idle, dripping = connect(server), connect(server)
    drip = b"GET /metrics HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 100
    assert closed_after(idle) < 5 * READ
    assert closed_after(dripping, drip) < 5 * READ  # each byte in time: the whole head is not
    idle.close(), dripping.close()
    deadline = time.monotonic() + 5  # the handler threads end (and free their slots) first:
    while threading.active_count() > threads and time.monotonic() < deadline:
        time.sleep(0.05)  # a scrape while both slots are still held is refused, as it should
    assert threading.active_count() <= threads
    assert "probe_events_total 3.0" in scrape(server)


def test_headers_dripped_after_a_prompt_request_line_are_cut(server: MetricsServer) -> None:
    conn = connect(server)
    conn.sendall(b"GET /metrics HTTP/1.1\r\n")  # the request line at once, the headers slowly
    assert closed_after(conn, b"Host: x\r\nX-Slow: " + b"a" * 100) < 5 * READ
    conn.close()


def test_connections_beyond_the_cap_are_closed_at_once(server: MetricsServer) -> None:
    held = [connect(server), connect(server)]
    time.sleep(0.1)  # both are being served
    extra = connect(server)
    assert closed_after(extra) < READ / 2 and server.refused == 1
    for conn in held:
        conn.close()
    time.sleep(0.2)
    assert "probe_events_total 3.0" in scrape(server)
