"""ControlService (workers → control plane): Register, Heartbeat, and the lease reaper."""

from __future__ import annotations

import asyncio
import contextlib
import logging

import grpc

from control_plane.cluster import Cluster
from control_plane.ledger import HeldReport, WorkerRef
from control_plane.registry import ROLE_NAMES, RegistrationError
from kvmesh.v1 import worker_pb2, worker_pb2_grpc

log = logging.getLogger(__name__)


def held_reports(held: list[worker_pb2.HeldBlockSet]) -> list[HeldReport]:
    return [HeldReport(h.request_id, h.generation, h.num_blocks) for h in held]


class ControlServicer(worker_pb2_grpc.ControlServiceServicer):
    def __init__(self, cluster: Cluster) -> None:
        self._cluster = cluster

    async def Register(
        self, request: worker_pb2.RegisterRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.RegisterResponse:
        cluster = self._cluster
        try:
            replaced = cluster.registry.register(request.worker, request.load)
        except RegistrationError as error:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))
        if replaced is not None:
            await cluster.worker_gone(replaced, expired=False)
        worker = WorkerRef(request.worker.worker_id, request.worker.epoch)
        cluster.ledger.adopt(worker, held_reports(list(request.held)))
        await cluster.refresh()
        cluster.metrics.worker_leases.labels(ROLE_NAMES[request.worker.role], "granted").inc()
        return worker_pb2.RegisterResponse(
            control_epoch=cluster.control_epoch,
            lease_seconds=cluster.config.lease_seconds,
            heartbeat_interval_seconds=cluster.config.heartbeat_interval_seconds,
        )

    async def Heartbeat(
        self, request: worker_pb2.HeartbeatRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.HeartbeatResponse:
        cluster = self._cluster
        epoch = cluster.control_epoch
        if not cluster.registry.heartbeat(request.worker_id, request.epoch, request.load):
            return worker_pb2.HeartbeatResponse(registered=False, control_epoch=epoch)
        record = cluster.registry.get(request.worker_id)
        if record is not None:
            cluster.metrics.worker_leases.labels(record.role, "renewed").inc()
        worker = WorkerRef(request.worker_id, request.epoch)
        release = cluster.ledger.reconcile(worker, held_reports(list(request.held)))
        return worker_pb2.HeartbeatResponse(
            registered=True, control_epoch=epoch, release_request_ids=release
        )


class Reaper:
    """Background task declaring workers dead when their lease lapses."""

    def __init__(self, cluster: Cluster) -> None:
        self._cluster = cluster
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="kvmesh-control-reaper")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _loop(self) -> None:
        interval = self._cluster.config.reap_interval_seconds
        while True:
            await asyncio.sleep(interval)
            try:
                await self._cluster.reap()
            except Exception:  # one failed pass must not end liveness checking for good
                log.exception("reaping dead workers failed; retrying next interval")
