"""A worker's lease outlasts one heartbeat lost without an answer: the agent gives up on a
heartbeat after lease - 2 x interval at most (`heartbeat_timeout`, from the lease the control
plane granted) and sends it again at once, so the lease is renewed before it lapses. A real
control plane and ControlAgent over loopback gRPC; the second heartbeat is never answered."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from control_plane.config import ControlConfig
from control_plane.control_service import ControlServicer
from control_plane.server import ControlServer
from kvmesh.security import Security
from kvmesh.service.agent import (
    MIN_HEARTBEAT_TIMEOUT_SECONDS,
    RPC_TIMEOUT_SECONDS,
    ControlAgent,
    heartbeat_timeout,
)
from kvmesh.v1 import generation_pb2, worker_pb2

TOKEN = "agent-lease-cluster-token-0123456789"
INFO = worker_pb2.WorkerInfo(
    worker_id="c0",
    role=worker_pb2.WORKER_ROLE_COLOCATED,
    address="127.0.0.1:1",  # never called
    epoch=7,
    layout=worker_pb2.KVCacheLayout(block_size=16),
    model=generation_pb2.ModelInfo(model_name="tiny"),
)


class Runtime:
    def load_proto(self) -> worker_pb2.WorkerLoad:
        return worker_pb2.WorkerLoad(total_blocks=64, free_blocks=64)


class Services:
    def held(self) -> list[worker_pb2.HeldBlockSet]:
        return []

    async def release(self, request_id: str, reason: str, generation: int) -> bool:
        return True


def test_heartbeat_deadline_leaves_room_for_a_retry_within_the_lease() -> None:
    # the defaults (lease 3 s, interval 1 s): renewed at t, a heartbeat lost at t + 1 is given
    # up at t + 2 and its retry has a second left
    assert heartbeat_timeout(3.0, 1.0) == 1.0
    assert heartbeat_timeout(30.0, 0.2) == RPC_TIMEOUT_SECONDS  # a long lease: the usual bound
    assert heartbeat_timeout(0.0, 1.0) == RPC_TIMEOUT_SECONDS  # no lease told
    assert heartbeat_timeout(1.0, 0.5) == MIN_HEARTBEAT_TIMEOUT_SECONDS  # a control plane's
    # lease too short for its interval (refused by ControlConfig) still gets a deadline


async def lose_one_heartbeat(beats: list[float]) -> None:
    config = ControlConfig(
        host="127.0.0.1",
        port=0,
        internal_port=0,
        lease_seconds=1.5,  # the defaults' ratio (three intervals), at half the time
        heartbeat_interval_seconds=0.5,
        reap_interval_seconds=0.05,
        security=Security(token=TOKEN),
    )
    server = ControlServer(config)
    await server.start()
    security = Security(token=TOKEN)
    agent = ControlAgent(server.internal_address, INFO, Runtime(), Services(), security)
    try:
        agent.start()
        await asyncio.wait_for(agent.registered.wait(), 5)
        registry = server.cluster.registry
        lapsed: list[int] = []
        async with asyncio.timeout(10):
            while len(beats) < 4:  # two renewals after the lost heartbeat
                if not registry.alive():
                    lapsed.append(len(beats))
                await asyncio.sleep(0.01)
        expired = server.cluster.metrics.worker_leases.labels("colocated", "expired")
        assert not lapsed, f"the lease lapsed after heartbeat {lapsed[0]}"
        assert expired._value.get() == 0 and agent.registrations == 1
        assert agent.lease == 1.5 and agent.interval == 0.5
    finally:
        await agent.stop()
        await server.stop()


def test_one_lost_heartbeat_does_not_end_the_workers_lease(monkeypatch: pytest.MonkeyPatch) -> None:
    beats: list[float] = []
    original = ControlServicer.Heartbeat

    async def lossy(
        servicer: ControlServicer,
        request: worker_pb2.HeartbeatRequest,
        context: grpc.aio.ServicerContext,
    ) -> worker_pb2.HeartbeatResponse:
        beats.append(asyncio.get_running_loop().time())
        if len(beats) == 2:  # lost: never answered (the agent's deadline ends the call)
            await asyncio.sleep(60)
        return await original(servicer, request, context)

    monkeypatch.setattr(ControlServicer, "Heartbeat", lossy)
    asyncio.run(lose_one_heartbeat(beats))
