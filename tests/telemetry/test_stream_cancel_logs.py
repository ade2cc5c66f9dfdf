"""A response stream the client cancels while the server is writing ends quietly on a server
with kvmesh's tracing interceptors: the traced handler's context is detached in the call's own
task, so OpenTelemetry logs no "Failed to detach context" traceback."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

import grpc
import pytest

from kvmesh.telemetry.tracing import server_interceptors

METHOD = "/kvmesh.test.Streams/Stream"
CHUNK = b"x" * 64  # the handler never awaits: the cancel finds the call's task in a write
TRACEPARENT = ("traceparent", "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01")


def _handler(closed: asyncio.Event) -> grpc.GenericRpcHandler:
    async def stream(request: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
        try:
            for _ in range(100_000):
                yield CHUNK
        finally:
            closed.set()

    handler = grpc.unary_stream_rpc_method_handler(stream)
    return grpc.method_handlers_generic_handler("kvmesh.test.Streams", {"Stream": handler})


async def _cancel_mid_stream() -> None:
    closed = asyncio.Event()
    server = grpc.aio.server(interceptors=server_interceptors())
    server.add_generic_rpc_handlers((_handler(closed),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stream = channel.unary_stream(METHOD, None, None)  # bytes as they are
            call = stream(b"", metadata=(TRACEPARENT,))
            await call.read()
            call.cancel()
            await asyncio.wait_for(closed.wait(), 5)
        await asyncio.sleep(0.1)
    finally:
        await server.stop(None)


def test_cancelled_stream_logs_no_detach_error(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING)
    asyncio.run(_cancel_mid_stream())
    noisy = [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info]
    assert not noisy, [f"{r.name}: {r.getMessage()}" for r in noisy]
