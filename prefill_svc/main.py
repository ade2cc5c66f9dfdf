"""`kvmesh serve prefill ...`: a prefill worker (PrefillService + KV senders).

Importing this module is light (no torch): `run` parses the options before the engine loads.
"""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvmesh.v1 import worker_pb2
from kvmesh.v1.transfer import WORKER_BACKENDS

if TYPE_CHECKING:
    from kvmesh.service.runtime import WorkerRuntime
    from kvmesh.service.server import WorkerServer
    from kvmesh.telemetry.metrics import WorkerMetrics
    from prefill_svc.senders import SenderPool
    from prefill_svc.service import PrefillServicer

PREFILL_SERVICE = worker_pb2.DESCRIPTOR.services_by_name["PrefillService"].full_name
# The calls a draining prefill worker refuses (UNAVAILABLE "draining"); Release still runs.
NEW_WORK = ("Prepare", "Prefill", "PrefillAhead")


class PrefillRole:
    """RoleServices of a prefill worker (it receives no KV: no transfer endpoints)."""

    def __init__(self, servicer: PrefillServicer, senders: SenderPool) -> None:
        self.servicer = servicer
        self.senders = senders
        self.transfer_endpoints: dict[str, str] = {name: "" for name in senders.backends}

    def held(self) -> list[worker_pb2.HeldBlockSet]:
        return self.servicer.held()

    async def release(self, request_id: str, reason: str, generation: int = 0) -> bool:
        return self.servicer.release(request_id, generation)

    async def close(self, timeout: float = 2.0) -> None:
        """Cancel prefills in progress (each releases its blocks) and close the senders, all
        within `timeout` s."""
        from kvmesh.service.server import close_within

        tasks = [a.task for a in self.servicer.active.values() if a.task is not None]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=timeout)
        await close_within([self.senders.close], timeout, "kv sender")


async def install(
    runtime: WorkerRuntime,
    server: WorkerServer,
    args: argparse.Namespace | None,
    metrics: WorkerMetrics | None,
) -> PrefillRole:
    """Create the sender pool and add PrefillService to `server`."""
    from kv_transfer.blocks import BlockStore
    from kvmesh.telemetry.metrics import WorkerMetrics
    from kvmesh.v1 import worker_pb2_grpc
    from prefill_svc.senders import SenderPool, available_backends
    from prefill_svc.service import PrefillServicer

    backends = available_backends(list(getattr(args, "transfer_backend", None) or WORKER_BACKENDS))
    store = BlockStore(*runtime.kv_cache_tensors(), model_id=runtime.layout.model_fingerprint)
    senders = SenderPool(store, backends, server.security)
    servicer = PrefillServicer(
        runtime,
        senders,
        metrics or WorkerMetrics("prefill"),
        transfer_overlap=bool(getattr(args, "transfer_overlap", True)),
    )
    server.add(
        worker_pb2_grpc.add_PrefillServiceServicer_to_server, servicer, PREFILL_SERVICE, NEW_WORK
    )
    return PrefillRole(servicer, senders)


def run(argv: Sequence[str] | None = None) -> int:
    """`kvmesh serve prefill ...`"""
    from kvmesh.service.process import serve_role

    return serve_role("prefill", argv, install)
