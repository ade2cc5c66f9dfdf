"""OpenTelemetry tracing configured once per process from the standard environment variables.

Honoured variables (read once, at `setup_tracing`):
- `OTEL_SDK_DISABLED=true`: no tracing at all.
- `OTEL_TRACES_EXPORTER`: `otlp`, `console`, or `none`, or a comma-separated list of them
  (`otlp_proto_grpc` / `otlp_proto_http` name OTLP with that protocol). Default: `otlp` when
  `OTEL_EXPORTER_OTLP_ENDPOINT` or `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` is set, else `none`.
- `OTEL_EXPORTER_OTLP_TRACES_PROTOCOL` / `OTEL_EXPORTER_OTLP_PROTOCOL`: `grpc` (default) or
  `http/protobuf`; the exporter itself reads the other `OTEL_EXPORTER_OTLP_*` variables
  (endpoint, headers, certificates, timeout) and `OTEL_BSP_*` tunes its batching.
- `OTEL_SERVICE_NAME`, `OTEL_RESOURCE_ATTRIBUTES`: the resource (via `Resource.create`).
With exporter `none` a real SDK tracer provider still runs (spans get ids, so trace context
propagates through the services and appears in logs) but nothing is exported.

gRPC servers are traced by `opentelemetry-instrumentation-grpc`: `server_interceptors()` goes
first on every grpc.aio server (a SERVER span per call, child of the caller's W3C
`traceparent`). `client_interceptors()` (kvmesh's `TracedCalls`) go on every internal grpc.aio
channel: a CLIENT span per call, its context injected into the metadata, ended when the call
is done (a cancel reaches the RPC). Health checks and heartbeats are not traced.
Response streams are written by a coroutine of the call's own task (`ClosingStreams`), so a
stream the client cancels is closed, and its span's context detached, where it was attached.
"""

from __future__ import annotations

import asyncio
import inspect
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import grpc
from opentelemetry import propagate, trace
from opentelemetry.instrumentation.utils import is_instrumentation_enabled
from opentelemetry.propagators.textmap import Setter
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    ConsoleSpanExporter,
    SimpleSpanProcessor,
    SpanExporter,
)

from kvmesh.v1 import wire

EXPORTERS = ("otlp", "otlp_proto_grpc", "otlp_proto_http", "console", "none")
PROTOCOLS = ("grpc", "http/protobuf")
UNTRACED_METHODS = ("/kvmesh.v1.ControlService/Heartbeat",)


class TracingConfigError(ValueError):
    """An OTEL_* variable has a value kvmesh cannot use."""


@dataclass(frozen=True)
class TracingConfig:
    disabled: bool
    exporter: str
    service_name: str
    protocol: str = "grpc"

    @property
    def exporters(self) -> tuple[str, ...]:
        return tuple(self.exporter.split(","))

    @classmethod
    def from_env(cls, default_service: str, env: Mapping[str, str] | None = None) -> TracingConfig:
        env = os.environ if env is None else env
        endpoints = ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
        has_endpoint = any(env.get(k) for k in endpoints)
        exporter = env.get("OTEL_TRACES_EXPORTER", "otlp" if has_endpoint else "none").lower()
        names = [name.strip() for name in exporter.split(",") if name.strip()] or ["none"]
        if any(name not in EXPORTERS for name in names):
            raise TracingConfigError(
                f"OTEL_TRACES_EXPORTER={exporter!r} is not supported; use one of {EXPORTERS}"
            )
        key = "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"
        if not env.get(key):
            key = "OTEL_EXPORTER_OTLP_PROTOCOL"
        protocol = env.get(key) or "grpc"
        if protocol not in PROTOCOLS:
            raise TracingConfigError(f"{key}={protocol!r} is not supported; use one of {PROTOCOLS}")
        return cls(
            disabled=env.get("OTEL_SDK_DISABLED", "").lower() == "true",
            exporter=",".join(names),
            service_name=env.get("OTEL_SERVICE_NAME") or default_service,
            protocol=protocol,
        )


def _exporters(config: TracingConfig) -> list[SpanExporter]:
    """One exporter per name of `OTEL_TRACES_EXPORTER` (`none` adds nothing)."""
    return [e for e in (_exporter(n, config.protocol) for n in config.exporters) if e is not None]


def _exporter(name: str, protocol: str) -> SpanExporter | None:
    if name == "console":
        return ConsoleSpanExporter()
    if name == "none":
        return None
    if name == "otlp_proto_http" or (name == "otlp" and protocol == "http/protobuf"):
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
            OTLPSpanExporter as HttpExporter,
        )

        return HttpExporter()
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

    return OTLPSpanExporter()


def setup_tracing(default_service: str) -> TracerProvider | None:
    """Install a global tracer provider for this process; returns it (None when disabled).

    Call once at process start, before serving (TracingConfigError for a bad variable). The
    provider flushes at interpreter exit; `provider.shutdown()` flushes earlier.
    """
    config = TracingConfig.from_env(default_service)
    if config.disabled:
        return None
    resource = Resource.create({SERVICE_NAME: config.service_name})
    provider = TracerProvider(resource=resource)
    for exporter in _exporters(config):
        console = isinstance(exporter, ConsoleSpanExporter)
        provider.add_span_processor(
            SimpleSpanProcessor(exporter) if console else BatchSpanProcessor(exporter)
        )
    trace.set_tracer_provider(provider)
    return provider


def tracer(name: str) -> trace.Tracer:
    """The tracer for a kvmesh component (a no-op tracer until `setup_tracing` ran)."""
    return trace.get_tracer(name)


def _traced() -> Any:
    from opentelemetry.instrumentation.grpc import filters

    untraced: list[Any] = [filters.health_check()]
    untraced += [filters.full_method_name(name) for name in UNTRACED_METHODS]
    return filters.negate(filters.any_of(*untraced))


def server_interceptors() -> list[Any]:
    """The tracing interceptor of a grpc.aio server (put it first: it sees every outcome)."""
    from opentelemetry.instrumentation.grpc import aio_server_interceptor

    return [ClosingStreams(aio_server_interceptor(filter_=_traced()))]


class ClosingStreams(grpc.aio.ServerInterceptor):
    """`inner` (the tracing interceptor) with its response streams written by a coroutine
    (`context.write`) that closes its generator in the call's own task when the call ends,
    cancelled included.

    grpc.aio iterates an async-generator handler itself; a call cancelled while it sends drops
    the generator, which asyncio's finalizer then closes from another task, where the tracing
    interceptor's context tokens (attached in the call's task) cannot be detached: an ERROR
    traceback from `opentelemetry.context` per cancelled stream.
    """

    def __init__(self, inner: grpc.aio.ServerInterceptor) -> None:
        self.inner = inner

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Any],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> Any:
        handler: Any = await self.inner.intercept_service(continuation, handler_call_details)
        if handler is None or not handler.response_streaming:
            return handler
        if handler.request_streaming:
            return handler._replace(stream_stream=_written(handler.stream_stream))
        return handler._replace(unary_stream=_written(handler.unary_stream))


def _written(behaviour: Callable[..., Any]) -> Callable[..., Any]:
    async def write_all(request: Any, context: grpc.aio.ServicerContext) -> None:
        result = behaviour(request, context)  # an async generator, or a coroutine that writes
        try:
            async for response in wire.responses_of(result):
                await context.write(response)
        finally:
            if inspect.isasyncgen(result):
                await result.aclose()  # in this task: where its context was attached

    return write_all


def client_interceptors() -> list[Any]:
    """The tracing interceptors of a grpc.aio channel (one per call shape): `TracedCalls`."""
    tracer = trace.get_tracer("kvmesh.grpc.client")
    kinds = (_TracedUnaryUnary, _TracedUnaryStream, _TracedStreamUnary, _TracedStreamStream)
    return [kind(tracer) for kind in kinds]


class _LowerCaseSetter(Setter[grpc.aio.Metadata]):
    """Sets propagation fields as gRPC metadata keys (lower case)."""

    def set(self, carrier: grpc.aio.Metadata, key: str, value: str) -> None:
        carrier[key.lower()] = value


class TracedCalls:
    """A CLIENT span per call of a grpc.aio channel, its context injected into the call's
    metadata (W3C `traceparent`, through the global propagator).

    The interceptor returns the call object as soon as the call is started and ends the span
    from the call's done callback, with the call's final status: `call.cancel()` (and a
    cancelled task awaiting the call) reaches the RPC itself, and a cancelled call's span ends
    CANCELLED. (An interceptor that awaits the call's outcome holds grpc.aio's interceptor task
    open: a cancel cancels that task instead of the RPC, the RPC runs on, and its span never
    ends.) Span name `/package.Service/Method`; `rpc.system`, `rpc.service`, `rpc.method`,
    `rpc.grpc.status_code`; ERROR with `error.type` for any status but OK."""

    def __init__(self, tracer: trace.Tracer) -> None:
        self._tracer = tracer
        self.traces = _traced()  # details -> bool: the servers' filter (no health, heartbeat)

    async def _traced(self, continuation: Any, details: Any, request: Any) -> Any:
        if not self.traces(details) or not is_instrumentation_enabled():
            return await continuation(details, request)
        method = details.method
        method = method.decode() if isinstance(method, bytes) else str(method)
        service, _, name = method.lstrip("/").partition("/")
        attributes = {
            "rpc.system": "grpc",
            "rpc.service": service,
            "rpc.method": name,
            "rpc.grpc.status_code": grpc.StatusCode.OK.value[0],
        }
        span = self._tracer.start_span(method, kind=trace.SpanKind.CLIENT, attributes=attributes)
        try:
            metadata = grpc.aio.Metadata(*(details.metadata or ()))
            propagate.inject(metadata, trace.set_span_in_context(span), _LowerCaseSetter())
            call = await continuation(details._replace(metadata=metadata), request)
        except BaseException as error:
            _end_span(span, *_status_of_error(error))
            raise
        if call.done():
            _end_span(span, *_status_of_call(call))
        else:
            call.add_done_callback(lambda done: _end_span(span, *_status_of_call(done)))
        return call


class _TracedUnaryUnary(TracedCalls, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return await self._traced(continuation, details, request)


class _TracedUnaryStream(TracedCalls, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return await self._traced(continuation, details, request)


class _TracedStreamUnary(TracedCalls, grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(self, continuation: Any, details: Any, requests: Any) -> Any:
        return await self._traced(continuation, details, requests)


class _TracedStreamStream(TracedCalls, grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(self, continuation: Any, details: Any, requests: Any) -> Any:
        return await self._traced(continuation, details, requests)


def _status_of_error(error: BaseException) -> tuple[grpc.StatusCode, str]:
    """The status a call that failed to start ends with."""
    if isinstance(error, grpc.aio.AioRpcError):
        return error.code(), error.details() or ""
    if isinstance(error, asyncio.CancelledError):
        return grpc.StatusCode.CANCELLED, "cancelled before the call started"
    return grpc.StatusCode.UNKNOWN, f"{type(error).__name__}: {error}"


def _status_of_call(call: Any) -> tuple[grpc.StatusCode, str]:
    """The final status of a call that is done. grpc.aio offers it as coroutines only; once the
    call is done they return without waiting, so they are run to completion here (a done
    callback cannot await)."""
    try:
        return _completed(call.code()), _completed(call.details()) or ""
    except Exception as error:  # a span must end whatever went wrong
        return grpc.StatusCode.UNKNOWN, f"the call's status could not be read: {error!r}"


def _completed(coroutine: Any) -> Any:
    """The result of `coroutine`, which must finish without suspending."""
    try:
        coroutine.send(None)
    except StopIteration as finished:
        return finished.value
    coroutine.close()
    raise RuntimeError("the call is not done")


def _end_span(span: trace.Span, code: grpc.StatusCode, details: str) -> None:
    try:
        span.set_attribute("rpc.grpc.status_code", code.value[0])
        if code != grpc.StatusCode.OK:
            mark_failed(span, code.name, details)
    finally:
        span.end()


def mark_failed(span: trace.Span, code_name: str, message: str) -> None:
    """Span status ERROR with the gRPC status name as `error.type` and in the description."""
    span.set_attribute("error.type", code_name)
    span.set_status(trace.Status(trace.StatusCode.ERROR, f"{code_name}: {message}"))
