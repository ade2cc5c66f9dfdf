"""kvmesh's client tracing interceptors on a real grpc.aio channel and server (loopback): a
CLIENT span per call, its context sent as `traceparent`, ended with the call's final status;
a cancel reaches the RPC on the server and ends the span CANCELLED."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

import grpc
import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from kvmesh.security.policy import Security
from tests.spans import in_memory_spans

SERVICE = "kvmesh.test.Calls"


@pytest.fixture(scope="module")
def exporter() -> Iterator[InMemorySpanExporter]:
    with in_memory_spans() as memory:
        yield memory


class Calls:
    """The server's side: what each call saw, and whether a handler was cancelled."""

    def __init__(self) -> None:
        self.metadata: list[dict[str, str]] = []
        self.started = asyncio.Event()
        self.cancelled = asyncio.Event()
        self.gate = asyncio.Event()

    def _seen(self, context: grpc.aio.ServicerContext) -> None:
        self.metadata.append({k: str(v) for k, v in context.invocation_metadata() or ()})

    async def echo(self, request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        self._seen(context)
        return request

    async def fail(self, request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        self._seen(context)
        await context.abort(grpc.StatusCode.NOT_FOUND, "no such thing")
        raise AssertionError("not reached")

    async def hold(self, request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        self._seen(context)
        self.started.set()
        try:
            await self.gate.wait()
        except asyncio.CancelledError:
            self.cancelled.set()
            raise
        return request

    async def gather(self, requests: AsyncIterator[bytes], context: Any) -> bytes:
        self._seen(context)
        return b"".join([r async for r in requests])

    async def stream(
        self, request: bytes, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[bytes]:
        self._seen(context)
        for _ in range(3):
            yield request

    def handler(self) -> grpc.GenericRpcHandler:
        return grpc.method_handlers_generic_handler(
            SERVICE,
            {
                "Echo": grpc.unary_unary_rpc_method_handler(self.echo),
                "Fail": grpc.unary_unary_rpc_method_handler(self.fail),
                "Hold": grpc.unary_unary_rpc_method_handler(self.hold),
                "Gather": grpc.stream_unary_rpc_method_handler(self.gather),
                "Stream": grpc.unary_stream_rpc_method_handler(self.stream),
            },
        )


Body = Callable[[grpc.aio.Channel, Calls], Awaitable[None]]


async def _with_server(body: Body, token: str | None = None) -> Calls:
    calls = Calls()
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((calls.handler(),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with Security(token=token).aio_channel(f"127.0.0.1:{port}") as channel:
            await body(channel, calls)
    finally:
        await server.stop(None)
    return calls


def _client_spans(exporter: InMemorySpanExporter, name: str) -> list[ReadableSpan]:
    return [
        s for s in exporter.get_finished_spans()
        if s.kind is trace.SpanKind.CLIENT and s.name == f"/{SERVICE}/{name}"
    ]  # fmt: skip


def test_a_call_sends_its_span_as_traceparent_and_ends_it_with_its_status(
    exporter: InMemorySpanExporter,
) -> None:
    exporter.clear()
    tracer = trace.get_tracer("test")

    async def body(channel: grpc.aio.Channel, calls: Calls) -> None:
        with tracer.start_as_current_span("parent"):
            assert await channel.unary_unary(f"/{SERVICE}/Echo")(b"hi") == b"hi"
            with pytest.raises(grpc.aio.AioRpcError):
                await channel.unary_unary(f"/{SERVICE}/Fail")(b"hi")
            gather = channel.stream_unary(f"/{SERVICE}/Gather")
            assert await gather(iter([b"a", b"b"])) == b"ab"
            assert [r async for r in channel.unary_stream(f"/{SERVICE}/Stream")(b"x")] == [b"x"] * 3

    calls = asyncio.run(_with_server(body, token="secret"))
    (parent,) = [s for s in exporter.get_finished_spans() if s.name == "parent"]
    (echo,) = _client_spans(exporter, "Echo")
    attributes = dict(echo.attributes or {})
    assert attributes == {
        "rpc.system": "grpc",
        "rpc.service": SERVICE,
        "rpc.method": "Echo",
        "rpc.grpc.status_code": 0,
    }
    assert echo.status.status_code is trace.StatusCode.UNSET
    assert echo.parent is not None and echo.parent.span_id == parent.context.span_id
    trace_id, span_id = format(echo.context.trace_id, "032x"), format(echo.context.span_id, "016x")
    assert calls.metadata[0]["traceparent"].startswith(f"00-{trace_id}-{span_id}-")
    assert calls.metadata[0]["authorization"] == "Bearer secret"  # the token still travels

    (fail,) = _client_spans(exporter, "Fail")
    assert fail.status.status_code is trace.StatusCode.ERROR
    assert fail.status.description == "NOT_FOUND: no such thing"
    assert dict(fail.attributes or {})["rpc.grpc.status_code"] == grpc.StatusCode.NOT_FOUND.value[0]
    assert dict(fail.attributes or {})["error.type"] == "NOT_FOUND"
    for name in ("Gather", "Stream"):
        (span,) = _client_spans(exporter, name)
        assert span.status.status_code is trace.StatusCode.UNSET
        assert dict(span.attributes or {})["rpc.grpc.status_code"] == 0
    sent = [m["traceparent"] for m in calls.metadata]
    assert len(set(sent)) == 4  # one span, and one traceparent, per call


@pytest.mark.parametrize("how", ["cancel", "task"])
def test_a_cancelled_call_is_cancelled_on_the_server_and_its_span_ends_cancelled(
    exporter: InMemorySpanExporter, how: str
) -> None:
    """`call.cancel()`, or cancelling the task that awaits the call, cancels the RPC itself
    (the server's handler is cancelled) and ends the CLIENT span CANCELLED."""
    exporter.clear()

    async def body(channel: grpc.aio.Channel, calls: Calls) -> None:
        call = channel.unary_unary(f"/{SERVICE}/Hold")(b"hi", timeout=30)
        waiter = asyncio.ensure_future(call)
        await asyncio.wait_for(calls.started.wait(), 5)
        if how == "cancel":
            call.cancel()
        else:
            waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        await asyncio.wait_for(calls.cancelled.wait(), 5)
        await asyncio.sleep(0)

    asyncio.run(_with_server(body))
    (span,) = _client_spans(exporter, "Hold")
    attributes = dict(span.attributes or {})
    assert span.status.status_code is trace.StatusCode.ERROR
    assert attributes["rpc.grpc.status_code"] == grpc.StatusCode.CANCELLED.value[0]
    assert attributes["error.type"] == "CANCELLED"
