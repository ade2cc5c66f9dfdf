"""grpc.aio server bootstrap for a worker: message limits, health, optional reflection, drain.

Every unary request is parsed by `wire.DecodeCheck`: an undecodable one (or one with a string
that is not UTF-8) is INVALID_ARGUMENT naming the field, never UNKNOWN. With a cluster token
the token check runs first: an unauthenticated call is refused before its bytes are parsed.

Health: "" and every added service are SERVING once started and NOT_SERVING while draining.
`serve_until_signal` runs a worker on uvloop until SIGTERM/SIGINT, then drains: the port stays
open, health answers NOT_SERVING, the calls that start new work (named by each role when it adds
its service) are refused UNAVAILABLE "draining", in-flight calls (and those that continue them:
Decode of a held reservation, Release) get `drain_seconds` to finish, the rest are cancelled.

Every gRPC port binds without SO_REUSEPORT: a port another process holds is an error (naming the
flag), never a port silently shared.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import signal
import sys
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Collection, Sequence
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from kvmesh.security import Security
from kvmesh.telemetry.request_scope import RequestScope
from kvmesh.telemetry.tracing import server_interceptors
from kvmesh.v1 import wire

DEFAULT_MAX_MESSAGE_BYTES = 16 << 20  # a worker port's largest message (prepared prompts)
DEFAULT_MAX_CONNECTION_IDLE_SECONDS = 300.0  # a connection without calls is closed after it
SERVING = health_pb2.HealthCheckResponse.SERVING
DRAINING = "draining: this worker is shutting down; retry on another worker"
STOP_GRACE_SECONDS = 0.5  # after the drain: lets finished calls flush, then cancels the rest
READY_PREFIX = "KVMESH_READY "
UNGATED = (f"/{health.SERVICE_NAME}/", "/grpc.reflection.")  # neither counted nor refused
LOG = logging.getLogger("kvmesh.service")


class DrainGate(grpc.aio.ServerInterceptor):
    """Counts the calls in flight and, once `close`d, refuses the methods in `new_work` (full
    names, "/pkg.Service/Method") with UNAVAILABLE "draining"; other calls (health, Release,
    Decode of a held reservation) still run. Place it after authentication."""

    def __init__(self) -> None:
        self.new_work: set[str] = set()
        self.draining = False
        self.in_flight = 0

    def close(self) -> None:
        """Refuse new work from now on."""
        self.draining = True

    async def idle(self, timeout: float) -> bool:
        """Wait until no call is in flight, at most `timeout` s; whether none is."""
        deadline = time.monotonic() + timeout
        while self.in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        return not self.in_flight

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Any],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> Any:
        handler = await continuation(handler_call_details)
        if handler is None or handler_call_details.method.startswith(UNGATED):
            return handler
        refuse = self.draining and handler_call_details.method in self.new_work
        kind = _kind(handler)
        behaviour = getattr(handler, kind)
        if handler.response_streaming:
            return handler._replace(**{kind: self._streaming(behaviour, refuse)})
        return handler._replace(**{kind: self._unary(behaviour, refuse)})

    def _unary(self, behaviour: Callable[..., Any], refuse: bool) -> Callable[..., Any]:
        async def counted(request: Any, context: grpc.aio.ServicerContext) -> Any:
            if refuse:
                await context.abort(grpc.StatusCode.UNAVAILABLE, DRAINING)
            self.in_flight += 1
            try:
                return await behaviour(request, context)
            finally:
                self.in_flight -= 1

        return counted

    def _streaming(self, behaviour: Callable[..., Any], refuse: bool) -> Callable[..., Any]:
        async def counted(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            if refuse:
                await context.abort(grpc.StatusCode.UNAVAILABLE, DRAINING)
            self.in_flight += 1
            try:
                async for response in wire.responses_of(behaviour(request, context)):
                    yield response
            finally:
                self.in_flight -= 1

        return counted


def _kind(handler: grpc.RpcMethodHandler) -> str:
    """The handler field that holds its behaviour (unary_unary, unary_stream, ...)."""
    request = "stream" if handler.request_streaming else "unary"
    response = "stream" if handler.response_streaming else "unary"
    return f"{request}_{response}"


class WorkerServer:
    """A grpc.aio server plus health; add services with `add`, then `start`. Every port of a
    worker is internal: with a cluster token in `security`, every call but health must carry it
    (UNAUTHENTICATED otherwise); with certificates it serves TLS (mutual TLS with a CA)."""

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        reflection: bool = False,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        max_connection_idle_seconds: float = DEFAULT_MAX_CONNECTION_IDLE_SECONDS,
        security: Security | None = None,
        on_refused: Callable[[], object] | None = None,
    ) -> None:
        self.host = host
        self.requested_port = port
        self.reflection = reflection
        self.max_connection_idle_seconds = max_connection_idle_seconds
        self.security = security or Security()
        self.auth = self.security.internal_interceptors(on_refused)
        self.gate = DrainGate()
        # Tracing sees every outcome; the token check comes before any parsing (a refused
        # call's bytes are never parsed), then the drain gate, the decode check, then the
        # request id's scope.
        interceptors = [*server_interceptors(), *self.auth, self.gate]
        self.server = grpc.aio.server(
            options=wire.server_options(max_message_bytes, max_connection_idle_seconds),
            interceptors=[*interceptors, wire.DecodeCheck(), RequestScope()],
        )
        self.health = health.aio.HealthServicer()  # type: ignore[attr-defined]
        self.service_names: list[str] = []
        self.port = 0

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def add(
        self,
        adder: Callable[[Any, grpc.aio.Server], None],
        servicer: Any,
        name: str,
        new_work: Collection[str] = (),
    ) -> None:
        """Register `servicer` with its generated `add_..._to_server` under its full name;
        `new_work`: its methods that start new work, refused UNAVAILABLE while draining."""
        adder(servicer, self.server)
        self.service_names.append(name)
        self.gate.new_work.update(f"/{name}/{method}" for method in new_work)

    async def start(self) -> None:
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        if self.reflection:
            from grpc_reflection.v1alpha import reflection

            names = (*self.service_names, health.SERVICE_NAME, reflection.SERVICE_NAME)
            reflection.enable_server_reflection(names, self.server)
        self.bind()
        await self.server.start()
        for name in ("", *self.service_names):
            await self.health.set(name, SERVING)

    def bind(self, field: str = "port") -> int:
        """Bind the port (once; `start` calls it too), so that a busy one fails before the rest
        of the worker starts: OSError "FIELD: cannot bind HOST:PORT: reason"."""
        if not self.port:
            address = f"{self.host}:{self.requested_port}"
            self.port = self.security.add_port(self.server, address, field=field)
        return self.port

    async def stop(self) -> None:
        """Stop at once, cancelling what runs (after `drain`: nothing left to do)."""
        self.gate.close()
        await self.server.stop(0)

    async def drain(self, grace: float) -> None:
        """NOT_SERVING everywhere and new work refused while the port stays open (health
        answers), in-flight calls get `grace` seconds, then the server stops (what is left is
        cancelled after `STOP_GRACE_SECONDS`)."""
        self.gate.close()
        await self.health.enter_graceful_shutdown()
        if not await self.gate.idle(grace):
            left = self.gate.in_flight
            LOG.warning("%d call(s) still in flight after the %.1f s drain", left, grace)
        await self.server.stop(min(grace, STOP_GRACE_SECONDS))


async def close_within(
    closers: Sequence[Callable[[], object]], timeout: float, what: str = "resource"
) -> None:
    """Run blocking `close` functions in parallel, each on its own daemon thread, and wait at
    most `timeout` s for all of them (a stuck one is logged and left behind)."""
    threads = [
        threading.Thread(target=_quietly, args=(close, what), name=f"close-{what}", daemon=True)
        for close in closers
    ]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + timeout
    while any(t.is_alive() for t in threads) and time.monotonic() < deadline:
        await asyncio.sleep(0.005)
    stuck = sum(t.is_alive() for t in threads)
    if stuck:
        LOG.warning("%d %s close call(s) still running after %.1f s", stuck, what, timeout)


def _quietly(close: Callable[[], object], what: str) -> None:
    try:
        close()
    except Exception:
        LOG.exception("closing a %s failed", what)


def print_ready(role: str, address: str, worker_id: str, **extra: Any) -> None:
    """The one machine-readable line supervisors and tests wait for."""
    line = {"role": role, "address": address, "worker_id": worker_id, **extra}
    print(READY_PREFIX + json.dumps(line, sort_keys=True), flush=True)


def run_until_signal(
    main: Callable[[asyncio.Event], Awaitable[None]], name: str = "kvmesh worker"
) -> int:
    """Run `main(stop_event)` on uvloop; SIGTERM/SIGINT set the event. Returns an exit code:
    2 with "NAME: message" on stderr for an OSError (a port that cannot be bound)."""

    async def runner() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.add_signal_handler(sig, stop.set)
        await main(stop)

    try:
        import uvloop

        uvloop.run(runner())
    except ImportError:  # pragma: no cover - uvloop is a dependency; plain asyncio still works
        asyncio.run(runner())
    except KeyboardInterrupt:
        return 130
    except OSError as exc:
        print(f"{name}: {exc}", file=sys.stderr)
        return 2
    return 0
