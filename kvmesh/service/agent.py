"""ControlAgent: a worker's registration and heartbeats with the control plane.

Register (retried with capped exponential backoff until it succeeds), then Heartbeat every
interval the control plane asked for, with load and held block sets. `registered=false`
(the control plane restarted) → register again, reporting what is held. The reply's
`release_request_ids` name ids by their reported generation: each is released locally only if
the role still holds exactly the generation this heartbeat reported for it (a set reserved
since, under a newer generation or a reused id, is kept). Every RPC has a deadline, a
heartbeat's short enough for the lease the control plane granted that one heartbeat lost without
an answer is sent again before the lease lapses (`heartbeat_timeout`). A failed call is retried
at once, further failures back off, so a worker survives control-plane restarts. Every call
carries the cluster token (over TLS when configured): the control plane's internal port refuses
any other.
"""

from __future__ import annotations

import asyncio
import logging
import random
from typing import Any

import grpc

from kvmesh.security import Security
from kvmesh.service.runtime import WorkerRuntime
from kvmesh.v1 import wire, worker_pb2, worker_pb2_grpc

LOG = logging.getLogger("kvmesh.service.agent")
RPC_TIMEOUT_SECONDS = 2.0
MIN_HEARTBEAT_TIMEOUT_SECONDS = 0.1  # a heartbeat's deadline, however short the lease
BACKOFF_MIN_SECONDS = 0.1
BACKOFF_MAX_SECONDS = 2.0
DEFAULT_INTERVAL_SECONDS = 1.0
RELEASE_REASON = "control plane released it"
# gRPC's own reconnect backoff grows to 120 s while the control plane is down, and a call made
# during it fails without trying to connect: bounded like the agent's own backoff, a control
# plane back after a long outage (a rescheduled pod, a crash loop) is found within seconds.
CONTROL_MESSAGE_BYTES = 4 * 1024 * 1024  # registrations and heartbeats: gRPC's default
CHANNEL_OPTIONS = wire.client_options(
    CONTROL_MESSAGE_BYTES, max_reconnect_backoff_ms=int(BACKOFF_MAX_SECONDS * 1000)
)


class ControlAgent:
    def __init__(
        self,
        target: str,
        info: worker_pb2.WorkerInfo,
        runtime: WorkerRuntime,
        services: Any,
        security: Security | None = None,
    ) -> None:
        self.target = target
        self.security = security or Security()
        self.info = info
        self.runtime = runtime
        self.services = services
        self.interval = DEFAULT_INTERVAL_SECONDS
        self.lease = 0.0  # the lease the control plane granted (0: not told yet)
        self.registrations = 0
        self.registered = asyncio.Event()
        self._channel: grpc.aio.Channel | None = None
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._channel = self.security.aio_channel(self.target, CHANNEL_OPTIONS)
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self._channel is not None:
            await self._channel.close(None)

    async def _run(self) -> None:
        assert self._channel is not None
        stub = worker_pb2_grpc.ControlServiceStub(self._channel)
        backoff = 0.0  # the first retry after a success goes at once: the lease is running
        while True:
            try:
                if not self.registered.is_set():
                    await self._register(stub)
                await self._heartbeat(stub)
                backoff = 0.0
                await asyncio.sleep(self.interval)
            except grpc.aio.AioRpcError as error:
                LOG.warning("control plane %s: %s %s", self.target, error.code(), error.details())
                await asyncio.sleep(backoff * (1 + random.random() / 2))
                backoff = min(max(backoff * 2, BACKOFF_MIN_SECONDS), BACKOFF_MAX_SECONDS)

    async def _register(self, stub: worker_pb2_grpc.ControlServiceStub) -> None:
        request = worker_pb2.RegisterRequest(
            worker=self.info, held=self.services.held(), load=self.runtime.load_proto()
        )
        response = await stub.Register(request, timeout=RPC_TIMEOUT_SECONDS)
        if response.heartbeat_interval_seconds > 0:
            self.interval = response.heartbeat_interval_seconds
        self.lease = response.lease_seconds
        self.registrations += 1
        self.registered.set()
        LOG.info("registered %s with control plane %s", self.info.worker_id, self.target)

    async def _heartbeat(self, stub: worker_pb2_grpc.ControlServiceStub) -> None:
        """Report load and held sets; release each id the reply names at the generation this
        heartbeat reported for it (the control plane names only reported ids)."""
        held = self.services.held()
        request = worker_pb2.HeartbeatRequest(
            worker_id=self.info.worker_id,
            epoch=self.info.epoch,
            load=self.runtime.load_proto(),
            held=held,
        )
        timeout = heartbeat_timeout(self.lease, self.interval)
        response = await stub.Heartbeat(request, timeout=timeout)
        if not response.registered:
            self.registered.clear()
            return
        reported = generations(held)
        for request_id in response.release_request_ids:
            generation = reported.get(request_id)
            if generation is not None:
                # the reported generation only: a set reserved since is never the one freed
                await self.services.release(request_id, RELEASE_REASON, generation)


def heartbeat_timeout(lease: float, interval: float) -> float:
    """The deadline of one Heartbeat: RPC_TIMEOUT_SECONDS, but never past lease - 2 x interval
    (nor under MIN_HEARTBEAT_TIMEOUT_SECONDS). Renewed at t, the lease lapses at t + lease; the
    next heartbeat leaves at t + interval and, lost without an answer, is given up by
    t + lease - interval and sent again at once, an interval before the lease lapses. Without a
    lease (0: a control plane that did not say) it is RPC_TIMEOUT_SECONDS."""
    if lease <= 0:
        return RPC_TIMEOUT_SECONDS
    return max(MIN_HEARTBEAT_TIMEOUT_SECONDS, min(RPC_TIMEOUT_SECONDS, lease - 2 * interval))


def generations(held: list[worker_pb2.HeldBlockSet]) -> dict[str, int]:
    """The generation held for each request id."""
    return {h.request_id: h.generation for h in held}
