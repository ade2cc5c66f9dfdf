"""ControlService over real gRPC: register, heartbeat, reconcile, restart, health, leases."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from cp_harness import control_plane, run_async
from cp_workers import FakeWorker
from grpc_health.v1 import health_pb2

from control_plane.server import GENERATION_SERVICE
from kvmesh.client import AsyncClient
from kvmesh.v1 import worker_pb2

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


@run_async
async def test_register_then_heartbeat_and_unknown_worker_is_not_registered() -> None:
    async with control_plane(lease_seconds=3.0) as cp:
        worker = await FakeWorker("d0", "decode").start()
        response = await cp.control.Register(
            worker_pb2.RegisterRequest(worker=worker.info(), load=worker.load()), timeout=5
        )
        assert response.control_epoch == cp.server.cluster.control_epoch
        assert response.lease_seconds == 3.0
        assert 0 < response.heartbeat_interval_seconds < response.lease_seconds
        assert (await worker.heartbeat(cp.control)).registered
        ghost = worker_pb2.HeartbeatRequest(worker_id="ghost", epoch=1)
        assert not (await cp.control.Heartbeat(ghost, timeout=5)).registered
        await worker.kill()


@run_async
async def test_register_with_a_bad_field_is_invalid_argument_naming_it() -> None:
    async with control_plane() as cp:
        info = FakeWorker("p0", "prefill").info(address="")
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await cp.control.Register(worker_pb2.RegisterRequest(worker=info), timeout=5)
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "worker.address" in (caught.value.details() or "")


@run_async
async def test_heartbeat_returns_releases_for_sets_the_ledger_does_not_hold() -> None:
    async with control_plane() as cp:
        worker = await cp.add("d0", "decode")
        worker.held["stray"] = worker_pb2.HeldBlockSet(request_id="stray", generation=5)
        response = await worker.heartbeat(cp.control)
        assert list(response.release_request_ids) == ["stray"]
        assert worker.held == {}
        await worker.kill()


@run_async
async def test_restarted_control_plane_makes_workers_reregister_and_releases_their_sets() -> None:
    worker = await FakeWorker("d0", "decode").start()
    async with control_plane() as first:
        await worker.register(first.control)
        worker.held["r1"] = worker_pb2.HeldBlockSet(request_id="r1", generation=7, num_blocks=2)
        old_epoch = first.server.cluster.control_epoch
    async with control_plane() as second:  # a new incarnation with an empty ledger
        response = await worker.heartbeat(second.control)
        assert not response.registered and response.control_epoch != old_epoch
        await worker.register(second.control)  # reports r1 as held
        assert second.server.cluster.ledger.orphans() != {}
        response = await worker.heartbeat(second.control)
        assert response.registered and list(response.release_request_ids) == ["r1"]
        assert worker.released == [("r1", 7)]
        await worker.heartbeat(second.control)
        assert second.server.cluster.ledger.orphans() == {}
    await worker.kill()


async def next_status(watch: object) -> int:
    response = await asyncio.wait_for(watch.read(), 5)  # type: ignore[attr-defined]
    return int(response.status)


@run_async
async def test_health_follows_the_usable_worker_set_and_drain() -> None:
    async with control_plane(lease_seconds=0.3, heartbeat_interval_seconds=0.1,
                             reap_interval_seconds=0.05) as cp:  # fmt: skip
        overall = await cp.health.Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
        assert overall.status == SERVING
        watch = cp.health.Watch(health_pb2.HealthCheckRequest(service=GENERATION_SERVICE))
        assert await next_status(watch) == NOT_SERVING
        prefill = await cp.add("p0", "prefill")
        alive = [asyncio.create_task(prefill.keep_alive(cp.control, 0.05))]
        decode = await cp.add("d0", "decode")
        assert await next_status(watch) == SERVING
        # The decode worker never heartbeats: its lease lapses and the pair is gone (the
        # prefill worker keeps its lease, so only the decode side's lapse changes health).
        assert await next_status(watch) == NOT_SERVING
        colocated = await cp.add("c0", "colocated")
        alive.append(asyncio.create_task(colocated.keep_alive(cp.control, 0.05)))
        assert await next_status(watch) == SERVING
        await cp.server.drain(grace=1.0)
        assert await next_status(watch) == NOT_SERVING
        watch.cancel()
        for task in alive:
            task.cancel()
        await asyncio.gather(*alive, return_exceptions=True)
        for worker in (prefill, decode, colocated):
            await worker.kill()


@run_async
async def test_async_client_serving_follows_the_usable_worker_set() -> None:
    async with control_plane() as cp, AsyncClient(cp.server.address, timeout=5) as client:
        assert not await client.serving()
        await cp.add("c0", "colocated")
        assert await client.serving()
