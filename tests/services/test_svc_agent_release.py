"""A heartbeat reply's `release_request_ids` free a held set only at the generation that heartbeat
reported: a reply that arrives after the worker reserved the id again, under the live entry's
newer generation, leaves that reservation alone; a set the ledger dropped is still freed. Real
control plane, ControlAgent and decode worker; only the heartbeat's trip is held back."""

from __future__ import annotations

import argparse
import asyncio
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from svc_harness import (
    LoopThread,
    RunningWorker,
    engine_config,
    start_worker,
    svc_loop,
    svc_model_dir,
    wait_until,
)

import kvmesh.service.agent as agent_module
from control_plane.config import ControlConfig
from control_plane.control_service import ControlServicer
from control_plane.ledger import Ledger, WorkerRef
from control_plane.server import ControlServer
from decode_svc.main import install
from kvmesh.service.agent import ControlAgent
from kvmesh.service.process import worker_info
from kvmesh.v1 import generation_pb2, worker_pb2, worker_pb2_grpc

__all__ = ["svc_loop", "svc_model_dir"]
REQUEST_ID = "reused"


class HeartbeatGate:
    """Holds Heartbeat calls back while closed (their trip on the network); records every
    call's reported (request id, generation) pairs and every reply's release ids."""

    def __init__(self, loop: LoopThread) -> None:
        self.loop = loop
        self.event = asyncio.Event()
        self.event.set()
        self.reports: list[set[tuple[str, int]]] = []
        self.replies: list[list[str]] = []

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        original = ControlServicer.Heartbeat

        async def delayed(
            servicer: ControlServicer,
            request: worker_pb2.HeartbeatRequest,
            context: grpc.aio.ServicerContext,
        ) -> worker_pb2.HeartbeatResponse:
            self.reports.append({(h.request_id, h.generation) for h in request.held})
            await self.event.wait()
            response = await original(servicer, request, context)
            self.replies.append(list(response.release_request_ids))
            return response

        monkeypatch.setattr(ControlServicer, "Heartbeat", delayed)

    def close(self) -> None:
        self.loop.loop.call_soon_threadsafe(self.event.clear)

    def open(self) -> None:
        self.loop.loop.call_soon_threadsafe(self.event.set)

    def wait_report(self, report: tuple[str, int]) -> int:
        """Wait for a heartbeat reporting `report`; returns how many heartbeats had arrived."""
        wait_until(lambda: any(report in r for r in self.reports), 5, f"a heartbeat with {report}")
        return len(self.reports)


@pytest.fixture()
def gate(svc_loop: LoopThread, monkeypatch: pytest.MonkeyPatch) -> HeartbeatGate:
    gate = HeartbeatGate(svc_loop)
    gate.install(monkeypatch)
    # the held-back heartbeat must be answered, not cut by the agent's deadline on a slow host
    # (bounded by the lease too: the control plane grants a long one)
    monkeypatch.setattr(agent_module, "RPC_TIMEOUT_SECONDS", 30.0)
    return gate


@pytest.fixture()
def control(svc_loop: LoopThread, gate: HeartbeatGate) -> Iterator[ControlServer]:
    async def start() -> ControlServer:
        config = ControlConfig(
            host="127.0.0.1",
            port=0,
            internal_port=0,
            lease_seconds=30.0,
            heartbeat_interval_seconds=0.2,
        )
        server = ControlServer(config)
        await server.start()
        return server

    server = svc_loop.run(start())
    yield server
    svc_loop.run(server.stop())


@pytest.fixture()
def decode(svc_loop: LoopThread, svc_model_dir: Path) -> Iterator[RunningWorker]:
    args = argparse.Namespace(transfer_backend=["shm"])
    worker = start_worker(svc_loop, engine_config(svc_model_dir), "decode", install, args)
    yield worker
    worker.stop()


@pytest.fixture()
def agent(
    svc_loop: LoopThread, control: ControlServer, decode: RunningWorker
) -> Iterator[ControlAgent]:
    info = worker_info(decode.runtime, "decode", decode.address, decode.role)

    async def start() -> ControlAgent:
        agent = ControlAgent(control.internal_address, info, decode.runtime, decode.role)
        agent.start()
        await asyncio.wait_for(agent.registered.wait(), 10)
        return agent

    agent = svc_loop.run(start())
    yield agent
    svc_loop.run(agent.stop())


def reserve(ledger: Ledger, worker: WorkerRef, decode: RunningWorker) -> int:
    """Open a new generation of REQUEST_ID and reserve it on `decode`, as the driver does."""
    generation = ledger.open(REQUEST_ID, time.monotonic() + 60).generation
    ledger.expect(REQUEST_ID, generation, worker)
    request = worker_pb2.EngineRequest(
        request_id=REQUEST_ID,
        prompt_ids=list(range(10, 40)),
        sampling=generation_pb2.SamplingParams(max_tokens=4),
    )
    stub = worker_pb2_grpc.DecodeServiceStub(decode.channel)
    reserve = worker_pb2.ReserveRequest(request=request, generation=generation, lease_seconds=20)
    reply = stub.Reserve(reserve, timeout=10)
    ledger.reserved(REQUEST_ID, generation, worker, len(reply.block_ids))
    return generation


def release(ledger: Ledger, decode: RunningWorker, outcome: str) -> None:
    """Close the live entry and send its Releases, as the driver does on a retry."""
    stub = worker_pb2_grpc.DecodeServiceStub(decode.channel)
    for rel in ledger.close(REQUEST_ID, outcome):
        request = worker_pb2.ReleaseRequest(request_id=REQUEST_ID, generation=rel.generation)
        stub.Release(request, timeout=5)


def held_generation(decode: RunningWorker) -> int | None:
    res: Any = decode.role.table.get(REQUEST_ID)
    return None if res is None else res.generation


def test_stale_heartbeat_reply_keeps_newer_generation(
    control: ControlServer, decode: RunningWorker, agent: ControlAgent, gate: HeartbeatGate
) -> None:
    ledger = control.cluster.ledger
    worker = WorkerRef(agent.info.worker_id, agent.info.epoch)
    first = reserve(ledger, worker, decode)
    gate.close()
    gate.wait_report((REQUEST_ID, first))  # this heartbeat is on its way, reporting `first`
    release(ledger, decode, "retried")
    second = reserve(ledger, worker, decode)  # the retry lands on the same worker
    arrived = len(gate.reports)
    gate.open()
    # the agent sends its next heartbeat only once it has acted on the stale reply
    wait_until(lambda: len(gate.reports) > arrived, 5, "the heartbeat after the stale one")
    assert [REQUEST_ID] in gate.replies, "the stale heartbeat was answered with a release"
    assert ledger.get(REQUEST_ID).generation == second and worker in ledger.holders(REQUEST_ID)
    assert held_generation(decode) == second

    ledger.close(REQUEST_ID, "lost")  # its Release never reaches the worker
    wait_until(lambda: held_generation(decode) is None, 5, "the dropped set freed by heartbeat")
