"""A real control-plane server on loopback ports with client stubs, for async tests.

As in production the internal door requires a cluster token (`TEST_TOKEN`) unless a test
configures other security; the harness's internal channel and its fake workers use the
server's token (and TLS), so every test runs through the authentication interceptors."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Coroutine
from dataclasses import dataclass, field, replace
from typing import Any

import grpc
from cp_workers import FakeWorker
from grpc_health.v1 import health_pb2_grpc

from control_plane.config import ControlConfig
from control_plane.server import ControlServer
from kvmesh.security import Security
from kvmesh.v1 import generation_pb2, generation_pb2_grpc, worker_pb2_grpc

TEST_TOKEN = "control-plane-test-cluster-token"
TEST_CONFIG = ControlConfig(
    host="127.0.0.1",
    port=0,
    internal_port=0,
    drain_seconds=2.0,
    security=Security(token=TEST_TOKEN),
)


def run_async(scenario: Callable[[], Coroutine[Any, Any, None]]) -> Callable[[], None]:
    """Turn an async test scenario into a plain test function (bounded by pytest-timeout)."""

    def test() -> None:
        asyncio.run(scenario())

    test.__name__ = scenario.__name__
    test.__doc__ = scenario.__doc__
    return test


@dataclass
class Harness:
    """`channel`, `generation` and `health` on the public door; `internal` (presenting the
    cluster token) and `control` on the internal one."""

    server: ControlServer
    channel: grpc.aio.Channel
    generation: generation_pb2_grpc.GenerationServiceStub
    control: worker_pb2_grpc.ControlServiceStub
    health: health_pb2_grpc.HealthStub
    internal: grpc.aio.Channel
    workers: list[FakeWorker] = field(default_factory=list)

    async def add(self, worker_id: str, role: str, **kwargs: Any) -> FakeWorker:
        """Start a worker peer and register it (stopped when the harness closes). By default
        it requires the server's cluster token and serves its TLS, as a real worker does."""
        server_security = self.server.config.security
        kwargs.setdefault(
            "security", Security(token=server_security.token, tls=server_security.tls)
        )
        worker = await FakeWorker(worker_id, role, **kwargs).start()
        self.workers.append(worker)
        await worker.register(self.control)
        return worker


@contextlib.asynccontextmanager
async def control_plane(**overrides: Any) -> AsyncIterator[Harness]:
    server = ControlServer(replace(TEST_CONFIG, **overrides))
    await server.start()
    channel = grpc.aio.insecure_channel(server.address)
    internal = server.config.security.aio_channel(server.internal_address)
    harness = Harness(
        server,
        channel,
        generation_pb2_grpc.GenerationServiceStub(channel),
        worker_pb2_grpc.ControlServiceStub(internal),
        health_pb2_grpc.HealthStub(channel),
        internal,
    )
    try:
        yield harness
    finally:
        await channel.close(grace=None)
        await internal.close(grace=None)
        await server.stop()
        for worker in harness.workers:
            await worker.kill()


def text_request(text: str = "hello world", **kwargs: Any) -> generation_pb2.GenerateRequest:
    return generation_pb2.GenerateRequest(text=text, **kwargs)


async def collect(call: Any) -> list[generation_pb2.GenerateResponse]:
    return [response async for response in call]


async def status_of(
    call: Any,
) -> tuple[grpc.StatusCode, str, list[generation_pb2.GenerateResponse]]:
    """Read a Generate stream to its end; returns (status code, details, responses)."""
    responses: list[generation_pb2.GenerateResponse] = []
    try:
        while (response := await call.read()) != grpc.aio.EOF:  # type: ignore[attr-defined]
            responses.append(response)
    except grpc.aio.AioRpcError as error:
        return error.code(), error.details() or "", responses
    return grpc.StatusCode.OK, "", responses
