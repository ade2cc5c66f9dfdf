"""Slow clients on the HTTP door (`openai_http.server.HttpServer` on loopback, raw sockets): a
request's head or body sent a byte at a time is cut at the server's request bound (slowloris),
while a request that arrived in time keeps its connection for a response that takes longer."""

from __future__ import annotations

import asyncio
import time

import pytest
from cp_harness import run_async
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import Route

from control_plane.openai_http.server import HttpServer

BOUND = 0.5  # the server's request_seconds in these tests


async def slow(request: Request) -> Response:
    body = await request.body()
    await asyncio.sleep(3 * BOUND)  # a response that takes longer than the bound
    return PlainTextResponse(f"{len(body)}")


def server() -> HttpServer:
    app = Starlette(routes=[Route("/slow", slow, methods=["GET", "POST"])])
    http = HttpServer(app, "127.0.0.1", 0, request_seconds=BOUND)
    http.start()
    return http


async def trickle(http: HttpServer, first: bytes, seconds: float) -> float | None:
    """Send `first`, then one more byte every 0.1 s; how long until the server closed the
    connection (None when it was still open after `seconds`)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", http.port)
    writer.write(first)
    began = time.monotonic()
    try:
        while time.monotonic() - began < seconds:
            try:
                if await asyncio.wait_for(reader.read(1024), 0.1) == b"":
                    return time.monotonic() - began
            except TimeoutError:
                writer.write(b"x")
                await writer.drain()
        return None
    except ConnectionError:
        return time.monotonic() - began
    finally:
        writer.close()


TRICKLED = {
    "head": b"GET /slow HTTP/1.1\r\nHost: x\r\nX-Slow: ",
    "body": b"POST /slow HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n",
}


@pytest.mark.parametrize("part", sorted(TRICKLED))
def test_a_request_sent_a_byte_at_a_time_is_cut_at_the_bound(part: str) -> None:
    """Its head (or, after a whole head, its body) trickling in a byte at a time: the
    connection is closed at the bound, not held for as long as the bytes keep coming."""

    async def scenario() -> None:
        http = server()
        try:
            closed = await trickle(http, TRICKLED[part], 10 * BOUND)
            assert closed is not None and closed < 4 * BOUND
        finally:
            await http.stop()

    run_async(scenario)()


@run_async
async def test_a_request_received_in_time_keeps_its_connection_for_a_slow_response() -> None:
    http = server()
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", http.port)
        for _ in range(2):  # and the keep-alive connection serves the next request too
            writer.write(b"POST /slow HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n\r\nabc")
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10 * BOUND)
            assert head.startswith(b"HTTP/1.1 200")
            assert await asyncio.wait_for(reader.readexactly(1), BOUND) == b"3"
        writer.close()
    finally:
        await http.stop()


async def large(request: Request) -> Response:
    return PlainTextResponse("x" * (20 << 20))  # more than the sockets' buffers take


@run_async
async def test_a_connection_whose_client_does_not_read_its_last_bytes_is_dropped() -> None:
    """A response written whole into the connection's buffer, never read: closing the
    connection (its next request did not come within the bound) would wait for the client to
    take every byte; still closing a bound later, it is aborted, its buffer freed."""
    app = Starlette(routes=[Route("/large", large)])
    http = HttpServer(app, "127.0.0.1", 0, request_seconds=BOUND)
    http.start()
    try:
        _unread, writer = await asyncio.open_connection("127.0.0.1", http.port)
        writer.write(b"GET /large HTTP/1.1\r\nHost: x\r\n\r\n")  # then never read
        connections = http._server.server_state.connections
        began = time.monotonic()
        while not connections:
            await asyncio.sleep(0.01)
        while connections and time.monotonic() - began < 10 * BOUND:
            await asyncio.sleep(0.05)
        assert not connections and time.monotonic() - began < 4 * BOUND
        writer.close()
    finally:
        await http.stop()
