"""`kvmesh serve decode ...`: a decode worker (DecodeService + KV transfer receivers).

Importing this module is light (no torch): `run` parses the options before the engine loads.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvmesh.v1 import worker_pb2
from kvmesh.v1.transfer import WORKER_BACKENDS

if TYPE_CHECKING:
    from decode_svc.reservations import ReservationTable
    from decode_svc.service import DecodeServicer
    from kv_transfer.registered import SharedRegion
    from kvmesh.service.runtime import WorkerRuntime
    from kvmesh.service.server import WorkerServer
    from kvmesh.telemetry.metrics import WorkerMetrics

DECODE_SERVICE = worker_pb2.DESCRIPTOR.services_by_name["DecodeService"].full_name
NEW_WORK = ("Reserve",)  # the calls a draining decode worker refuses (UNAVAILABLE "draining")


class DecodeRole:
    """RoleServices of a decode worker."""

    def __init__(self, servicer: DecodeServicer, table: ReservationTable) -> None:
        self.servicer = servicer
        self.table = table
        self.transfer_endpoints = {name: r.address for name, r in table.receivers.items()}

    def held(self) -> list[worker_pb2.HeldBlockSet]:
        return self.table.held()

    async def release(self, request_id: str, reason: str, generation: int = 0) -> bool:
        return self.servicer.release(request_id, generation, reason)

    async def close(self) -> None:
        await self.table.close()


async def install(
    runtime: WorkerRuntime,
    server: WorkerServer,
    args: argparse.Namespace | None,
    metrics: WorkerMetrics | None,
) -> DecodeRole:
    """Open the KV receivers and add DecodeService to `server`."""
    from decode_svc.reservations import ReservationTable, open_receivers
    from decode_svc.service import DecodeServicer
    from kv_transfer.blocks import BlockStore
    from kvmesh.telemetry.metrics import WorkerMetrics
    from kvmesh.v1 import worker_pb2_grpc

    backends = list(getattr(args, "transfer_backend", None) or WORKER_BACKENDS)
    region = await share_kv_cache(runtime) if "shm" in backends else None
    cache, scales = runtime.kv_cache_tensors()
    store = BlockStore(cache, scales, model_id=runtime.layout.model_fingerprint, region=region)
    host = getattr(args, "host", None) or "127.0.0.1"
    port = getattr(args, "transfer_port", None) or 0
    receivers = open_receivers(
        store, backends, host, port, server.security, server.max_connection_idle_seconds
    )
    table = ReservationTable(runtime.engine, receivers)
    table.start_reaper()
    servicer = DecodeServicer(runtime, table, metrics or WorkerMetrics("decode"))
    server.add(  # a draining worker takes no new reservation; Decode of a held one still runs
        worker_pb2_grpc.add_DecodeServiceServicer_to_server, servicer, DECODE_SERVICE, NEW_WORK
    )
    return DecodeRole(servicer, table)


async def share_kv_cache(runtime: WorkerRuntime) -> SharedRegion | None:
    """Move a CPU KV cache into an anonymous shared mapping, so that same-host senders write
    into it in one copy (registered memory); None for a device cache."""
    from kv_transfer.registered import shared_tensors

    cache, scales = runtime.kv_cache_tensors()
    if cache.device.type != "cpu":
        return None
    scales_shape = None if scales is None else tuple(scales.shape)
    data, shared_scales, region = shared_tensors(tuple(cache.shape), cache.dtype, scales_shape)
    await runtime.engine.call(lambda engine: engine.move_kv_cache(data, shared_scales))
    return region


def run(argv: Sequence[str] | None = None) -> int:
    """`kvmesh serve decode ...`"""
    from kvmesh.service.process import serve_role

    return serve_role("decode", argv, install, check_transfer_ports)


def check_transfer_ports(args: argparse.Namespace) -> None:
    """OSError naming --transfer-port when a network KV receiver's chosen port is taken, before
    the model loads (`open_receivers` binds them for real later)."""
    from kv_transfer import receiver_ports
    from kvmesh.service.process import check_port

    backends = list(getattr(args, "transfer_backend", None) or WORKER_BACKENDS)
    for port in receiver_ports(backends, args.transfer_port).values():
        check_port(args.host, port, "--transfer-port")
