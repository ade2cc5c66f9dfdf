"""A grpc.aio server interceptor that puts a worker call's request id in scope.

The id is the request message's `request_id`, or its `request.request_id` or
`prompt.request_id` (PrepareRequest, PrefillRequest, ReserveRequest, ColocatedRequest). While
the call runs, log lines carry it (`kvmesh.telemetry.logs`) and the call's server span has it
as `kvmesh.request_id`. Place it after the decode check: it reads parsed messages. Calls with a
request stream pass through; their handler calls `enter` once it knows the id.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
from opentelemetry import trace

from kvmesh.telemetry.logs import bind_request_id
from kvmesh.v1 import wire

REQUEST_ID_ATTRIBUTE = "kvmesh.request_id"


def request_id_of(message: Any) -> str:
    """The request id a worker message names ("" when it names none)."""
    rid = getattr(message, "request_id", None)
    for inner in ("request", "prompt"):
        if not rid:
            rid = getattr(getattr(message, inner, None), "request_id", None)
    return rid if isinstance(rid, str) else ""


def enter(request_id: str) -> None:
    """Put `request_id` in scope for the rest of the current call (logs, server span)."""
    if request_id:
        bind_request_id(request_id)
        trace.get_current_span().set_attribute(REQUEST_ID_ATTRIBUTE, request_id)


def _enter(message: Any) -> None:
    enter(request_id_of(message))


def _unary(behaviour: Callable[..., Any]) -> Callable[..., Any]:
    async def scoped(request: Any, context: grpc.aio.ServicerContext) -> Any:
        _enter(request)
        return await behaviour(request, context)

    return scoped


def _streaming(behaviour: Callable[..., Any]) -> Callable[..., Any]:
    async def scoped(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        _enter(request)
        async for response in wire.responses_of(behaviour(request, context)):
            yield response

    return scoped


class RequestScope(grpc.aio.ServerInterceptor):
    """Binds the request id of unary-request calls (see the module docstring)."""

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Any],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> Any:
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_streaming:
            return handler
        if handler.response_streaming:
            return handler._replace(unary_stream=_streaming(handler.unary_stream))
        return handler._replace(unary_unary=_unary(handler.unary_unary))
