"""Idle gRPC connections are bounded: a connection with no call for `max_connection_idle_seconds`
is closed with GOAWAY on both control-plane doors and on a worker port, even when its
peer answers every keepalive ping; a stream in flight is never cut; and the project's channels
(the Python client, the control plane's channels to workers, a worker's channel to the internal
door) reconnect by themselves on their next call."""

from __future__ import annotations

import asyncio

import grpc
from cp_harness import Harness, control_plane, run_async, status_of, text_request
from grpc_health.v1 import health_pb2, health_pb2_grpc

from control_plane.cluster import ChannelPool
from kvmesh.client import AsyncClient
from kvmesh.security import Security
from kvmesh.service.server import WorkerServer
from tests.http2 import closed_with_goaway

IDLE = 0.3  # seconds: the bound under test
TOKENS = 9  # of a request: the prefill's first, then 8 from the decode worker


async def went_idle(channel: grpc.aio.Channel, seconds: float = 5.0) -> None:
    """Wait until the server closed `channel`'s connection (the channel is IDLE again)."""
    async with asyncio.timeout(seconds):
        while channel.get_state() != grpc.ChannelConnectivity.IDLE:
            await channel.wait_for_state_change(channel.get_state())


async def pair(cp: Harness) -> None:
    await cp.add("p0", "prefill")
    decode = await cp.add("d0", "decode")
    decode.tokens, decode.pace = 8, 0.1  # a stream of 0.7 s: longer than the idle bound


@run_async
async def test_idle_connections_to_both_doors_get_goaway() -> None:
    async with control_plane(max_connection_idle_seconds=IDLE) as cp:
        public, internal = cp.server.address, cp.server.internal_address
        assert await asyncio.gather(closed_with_goaway(public), closed_with_goaway(internal)) == [
            True,
            True,
        ]


@run_async
async def test_idle_connection_to_a_worker_port_gets_goaway() -> None:
    server = WorkerServer(max_connection_idle_seconds=IDLE)
    await server.start()
    try:
        assert await closed_with_goaway(server.address)
    finally:
        await server.stop()


@run_async
async def test_a_stream_in_flight_outlives_the_idle_bound() -> None:
    async with control_plane(max_connection_idle_seconds=IDLE) as cp:
        await pair(cp)
        call = cp.generation.Generate(text_request("hi"), timeout=10)
        code, details, responses = await status_of(call)
        assert (code, len(responses)) == (grpc.StatusCode.OK, TOKENS), details


@run_async
async def test_the_client_and_internal_channels_reconnect_after_goaway() -> None:
    async with control_plane(max_connection_idle_seconds=IDLE) as cp:
        await pair(cp)
        async with AsyncClient(cp.server.address) as client:
            for _ in range(2):
                assert len((await client.complete("hi")).completions[0].token_ids) == TOKENS
                await went_idle(client._channel)
        health = health_pb2_grpc.HealthStub(cp.internal)  # as a worker's agent dials it
        for _ in range(2):
            await health.Check(health_pb2.HealthCheckRequest(), timeout=5)
            await went_idle(cp.internal)


@run_async
async def test_the_control_planes_worker_channel_reconnects_after_goaway() -> None:
    server = WorkerServer(max_connection_idle_seconds=IDLE)
    await server.start()
    pool = ChannelPool(1 << 20, Security())
    try:
        channel = pool.get(server.address)
        health = health_pb2_grpc.HealthStub(channel)
        for _ in range(2):
            await health.Check(health_pb2.HealthCheckRequest(), timeout=5)
            await went_idle(channel)
    finally:
        await pool.close()
        await server.stop()
