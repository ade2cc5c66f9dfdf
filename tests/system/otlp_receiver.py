"""A real OTLP/gRPC trace receiver on loopback (the collector's TraceService), for tests."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1 import common_pb2
from opentelemetry.proto.trace.v1 import trace_pb2

SpanKind = trace_pb2.Span.SpanKind
StatusCode = trace_pb2.Status.StatusCode


def value_of(value: common_pb2.AnyValue) -> Any:
    which = value.WhichOneof("value")
    if which == "array_value":
        return [value_of(v) for v in value.array_value.values]
    return getattr(value, which) if which else None


@dataclass
class Span:
    """One received span: ids as hex, attributes as Python values, its resource's service."""

    service: str
    name: str
    kind: int
    trace_id: str
    span_id: str
    parent_id: str
    status: int
    status_message: str
    attributes: dict[str, Any]
    events: list[tuple[str, dict[str, Any]]] = field(default_factory=list)


def convert(service: str, span: trace_pb2.Span) -> Span:
    return Span(
        service=service,
        name=span.name,
        kind=span.kind,
        trace_id=span.trace_id.hex(),
        span_id=span.span_id.hex(),
        parent_id=span.parent_span_id.hex(),
        status=span.status.code,
        status_message=span.status.message,
        attributes={a.key: value_of(a.value) for a in span.attributes},
        events=[(e.name, {a.key: value_of(a.value) for a in e.attributes}) for e in span.events],
    )


class Receiver(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self) -> None:
        self.spans: list[Span] = []
        self._lock = threading.Lock()

    def Export(
        self, request: trace_service_pb2.ExportTraceServiceRequest, context: Any
    ) -> trace_service_pb2.ExportTraceServiceResponse:
        received = []
        for resource_spans in request.resource_spans:
            attrs = {a.key: value_of(a.value) for a in resource_spans.resource.attributes}
            service = str(attrs.get("service.name", ""))
            for scope in resource_spans.scope_spans:
                received += [convert(service, span) for span in scope.spans]
        with self._lock:
            self.spans += received
        return trace_service_pb2.ExportTraceServiceResponse()

    def trace(self, trace_id: str) -> list[Span]:
        with self._lock:
            return [s for s in self.spans if s.trace_id == trace_id]

    def wait(self, done: Callable[[], bool], timeout: float = 15.0) -> None:
        deadline = time.monotonic() + timeout
        while not done():
            if time.monotonic() > deadline:
                raise TimeoutError(f"spans not received in {timeout} s: {self.spans!r}"[:4000])
            time.sleep(0.05)


@contextmanager
def otlp_receiver() -> Iterator[tuple[Receiver, str]]:
    """A started receiver and its `http://127.0.0.1:PORT` endpoint."""
    receiver = Receiver()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(receiver, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield receiver, f"http://127.0.0.1:{port}"
    finally:
        server.stop(0)
