"""grpc.aio server bootstrap for a worker: message limits, health, optional reflection, drain.

Every unary request is parsed by `wire.DecodeCheck`: an undecodable one (or one with a string
that is not UTF-8) is INVALID_ARGUMENT naming the field, never UNKNOWN. With a cluster token
the token check runs first: an unauthenticated call is refused before its bytes are parsed.

Health: "" and every added service are SERVING once started and NOT_SERVING while draining.
`serve_until_signal` runs a worker on uvloop until SIGTERM/SIGINT, then drains: health goes
NOT_SERVING, in-flight calls get `drain_seconds` to finish, the rest are cancelled.
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
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from kvmesh.security import Security
from kvmesh.telemetry.request_scope import RequestScope
from kvmesh.telemetry.tracing import server_interceptors
from kvmesh.v1 import wire

DEFAULT_MAX_MESSAGE_BYTES = 16 << 20  # a worker port's largest message (prepared prompts)
SERVING = health_pb2.HealthCheckResponse.SERVING
READY_PREFIX = "KVMESH_READY "
LOG = logging.getLogger("kvmesh.service")


def server_options(max_message_bytes: int) -> list[tuple[str, int]]:
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.keepalive_time_ms", 10_000),
        ("grpc.keepalive_timeout_ms", 5_000),
        ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
        ("grpc.keepalive_permit_without_calls", 1),
    ]


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
        security: Security | None = None,
        on_refused: Callable[[], object] | None = None,
    ) -> None:
        self.host = host
        self.requested_port = port
        self.reflection = reflection
        self.security = security or Security()
        self.auth = self.security.internal_interceptors(on_refused)
        # Tracing sees every outcome; the token check comes before any parsing (a refused
        # call's bytes are never parsed), then the decode check, then the request id's scope.
        self.server = grpc.aio.server(
            options=server_options(max_message_bytes),
            interceptors=[*server_interceptors(), *self.auth, wire.DecodeCheck(), RequestScope()],
        )
        self.health = health.aio.HealthServicer()  # type: ignore[attr-defined]
        self.service_names: list[str] = []
        self.port = 0

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def add(self, adder: Callable[[Any, grpc.aio.Server], None], servicer: Any, name: str) -> None:
        """Register `servicer` with its generated `add_..._to_server` under its full name."""
        adder(servicer, self.server)
        self.service_names.append(name)

    async def start(self) -> None:
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        if self.reflection:
            from grpc_reflection.v1alpha import reflection

            names = (*self.service_names, health.SERVICE_NAME, reflection.SERVICE_NAME)
            reflection.enable_server_reflection(names, self.server)
        self.port = self.security.add_port(self.server, f"{self.host}:{self.requested_port}")
        if self.port == 0:
            raise OSError(f"port: cannot bind {self.host}:{self.requested_port}")
        await self.server.start()
        for name in ("", *self.service_names):
            await self.health.set(name, SERVING)

    async def drain(self, grace: float) -> None:
        """NOT_SERVING everywhere, then stop, giving in-flight calls `grace` seconds."""
        await self.health.enter_graceful_shutdown()
        await self.server.stop(grace)


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


def run_until_signal(main: Callable[[asyncio.Event], Awaitable[None]]) -> int:
    """Run `main(stop_event)` on uvloop; SIGTERM/SIGINT set the event. Returns an exit code."""

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
        print(f"kvmesh worker: {exc}", file=sys.stderr)
        return 2
    return 0
