"""Bearer-secret checks on grpc.aio servers, and attaching the secret on grpc.aio channels.

`BearerAuth` runs before any servicer: a call to a guarded method without
`authorization: Bearer SECRET` matching one of the allowed secrets gets UNAUTHENTICATED with a
plain message, its request bytes are never parsed, and no servicer code runs (nothing changes).
Health checks (`/grpc.health.v1.Health/`) stay open for probes.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

import grpc

from kvmesh.security.credentials import bearer, matches

LOG = logging.getLogger("kvmesh.security")
HEALTH_PREFIX = "/grpc.health.v1.Health/"
LOG_EVERY_SECONDS = 10.0
Continuation = Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler | None]]


class BearerAuth(grpc.aio.ServerInterceptor):
    """Refuse calls whose bearer secret is missing or not one of `secrets`.

    `what` names the secret in messages ("cluster token", "API key"). `refused` counts the
    calls refused (tests and logs read it); `on_refused` is called for each one."""

    def __init__(
        self,
        secrets: Sequence[str],
        what: str,
        open_prefixes: Sequence[str] = (),
        on_refused: Callable[[], object] | None = None,
    ) -> None:
        if not secrets:
            raise ValueError("BearerAuth needs at least one secret")
        self._secrets = tuple(secrets)
        self.what = what
        self._open = (HEALTH_PREFIX, *open_prefixes)
        self.refused = 0
        self._on_refused = on_refused  # e.g. a Prometheus counter's inc
        self._logged_at = -LOG_EVERY_SECONDS
        self._logged_count = 0

    def _log(self, method: str, problem: str) -> None:
        """One warning per LOG_EVERY_SECONDS at most: a flood of forged calls cannot flood
        the log."""
        now = time.monotonic()
        if now - self._logged_at < LOG_EVERY_SECONDS:
            return
        since = self.refused - self._logged_count
        self._logged_at, self._logged_count = now, self.refused
        LOG.warning("refused %s: %s %s (%d refused since the last report)", method, problem,
                    self.what, since)  # fmt: skip

    async def intercept_service(  # type: ignore[override]
        self, continuation: Continuation, details: grpc.HandlerCallDetails
    ) -> grpc.RpcMethodHandler | None:
        handler = await continuation(details)
        method = details.method or ""
        if handler is None or method.startswith(self._open):
            return handler
        presented = bearer(details.invocation_metadata)  # type: ignore[arg-type]
        if presented is not None and matches(presented, self._secrets):
            return handler
        self.refused += 1
        if self._on_refused is not None:
            self._on_refused()
        problem = "missing" if presented is None else "wrong"
        self._log(method, problem)
        hint = f"send 'authorization: Bearer <{self.what}>'"
        return refusal(handler, f"{problem} {self.what}: {hint}")


def refusal(handler: grpc.RpcMethodHandler, message: str) -> grpc.RpcMethodHandler:
    """A handler of the same shape as `handler` that aborts with UNAUTHENTICATED before reading
    anything (requests stay raw bytes, never deserialized)."""

    async def deny(context: grpc.aio.ServicerContext) -> None:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    async def unary(request: Any, context: grpc.aio.ServicerContext) -> None:
        await deny(context)

    async def streaming(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        await deny(context)
        yield  # pragma: no cover - never reached: deny raises

    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(streaming)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(unary)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(streaming)
    return grpc.unary_unary_rpc_method_handler(unary)


class _Attach:
    """Adds fixed metadata (the bearer secret) to a call's details."""

    def __init__(self, pairs: Sequence[tuple[str, str]]) -> None:
        self._pairs = tuple(pairs)

    def _details(self, details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        metadata = grpc.aio.Metadata(*(details.metadata or ()), *self._pairs)
        return details._replace(metadata=metadata)  # type: ignore[attr-defined, no-any-return]


class _AttachUnaryUnary(_Attach, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return await continuation(self._details(details), request)


class _AttachUnaryStream(_Attach, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return await continuation(self._details(details), request)


class _AttachStreamUnary(_Attach, grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(self, continuation: Any, details: Any, requests: Any) -> Any:
        return await continuation(self._details(details), requests)


class _AttachStreamStream(_Attach, grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(self, continuation: Any, details: Any, requests: Any) -> Any:
        return await continuation(self._details(details), requests)


def attach_metadata(pairs: Sequence[tuple[str, str]]) -> list[Any]:
    """Client interceptors adding `pairs` to every call of a grpc.aio channel (one per call
    kind: grpc.aio files each interceptor under the first kind it implements)."""
    kinds = (_AttachUnaryUnary, _AttachUnaryStream, _AttachStreamUnary, _AttachStreamStream)
    return [kind(pairs) for kind in kinds]
