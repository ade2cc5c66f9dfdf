"""Release calls to workers: best effort, each bounded; a worker that misses one is told again
by its next heartbeat (the ledger no longer holds the set live)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable

import grpc

from control_plane.cluster import Cluster
from control_plane.ledger import Release
from kvmesh.v1 import worker_pb2, worker_pb2_grpc

LOG = logging.getLogger("kvmesh.control_plane")


async def send_releases(cluster: Cluster, releases: Iterable[Release]) -> None:
    """Send every Release in parallel; returns when each was answered or timed out."""
    await asyncio.gather(*(send_release(cluster, r) for r in releases))


async def send_release(cluster: Cluster, release: Release) -> None:
    """One Release to the incarnation it names (skipped when that incarnation is gone)."""
    record = cluster.registry.get(release.worker.worker_id)
    if record is None or record.epoch != release.worker.epoch:
        return
    channel = cluster.channels.get(record.address)
    stub: worker_pb2_grpc.DecodeServiceStub | worker_pb2_grpc.PrefillServiceStub
    if record.role == "decode":
        stub = worker_pb2_grpc.DecodeServiceStub(channel)
    else:
        stub = worker_pb2_grpc.PrefillServiceStub(channel)
    request = worker_pb2.ReleaseRequest(
        request_id=release.request_id, generation=release.generation, reason="closed"
    )
    try:
        await stub.Release(request, timeout=cluster.config.release_timeout_seconds)
    except grpc.aio.AioRpcError as error:
        LOG.warning(
            "release of %s on %s failed: %s", release.request_id, record.worker_id, error.code()
        )


class BackgroundReleases:
    """Releases sent without making the request wait for them (tasks kept until done)."""

    def __init__(self, cluster: Cluster) -> None:
        self._cluster = cluster
        self._tasks: set[asyncio.Task[None]] = set()

    def send(self, releases: Iterable[Release]) -> None:
        task = asyncio.get_running_loop().create_task(send_releases(self._cluster, releases))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
