"""The control plane's shared state: registry, ledger, channels to workers, and the listeners
told when a worker incarnation is gone or the set of usable workers changes."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable

import grpc

from control_plane.config import ControlConfig
from control_plane.ledger import EntryState, Ledger, WorkerRef
from control_plane.metrics import ControlMetrics
from control_plane.registry import Registry, WorkerRecord
from kvmesh.security import Security
from kvmesh.v1 import wire

WorkerLostListener = Callable[[WorkerRef], None]
ServingListener = Callable[[bool], Awaitable[None]]


class ChannelPool:
    """One grpc.aio channel per worker address, closed when no registered worker is at that
    address any more (`Cluster.worker_gone`). Every call on it carries the cluster token, over
    TLS when configured."""

    def __init__(self, max_message_bytes: int, security: Security | None = None) -> None:
        self._security = security or Security()
        self._options = wire.client_options(max_message_bytes)
        self._channels: dict[str, grpc.aio.Channel] = {}

    def get(self, address: str) -> grpc.aio.Channel:
        channel = self._channels.get(address)
        if channel is None:
            channel = self._security.aio_channel(address, self._options)
            self._channels[address] = channel
        return channel

    async def drop(self, address: str) -> None:
        channel = self._channels.pop(address, None)
        if channel is not None:
            await channel.close(grace=None)

    async def close(self) -> None:
        for address in list(self._channels):
            await self.drop(address)


class Cluster:
    def __init__(
        self,
        config: ControlConfig,
        metrics: ControlMetrics | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.clock = clock
        self.control_epoch = random.SystemRandom().getrandbits(63) | 1
        self.registry = Registry(config.lease_seconds, clock)
        self.ledger = Ledger(
            clock, config.history_size, reservation_lease=config.reservation_lease_seconds
        )
        self.metrics = metrics or ControlMetrics()
        live = tuple(state.name for state in EntryState if state is not EntryState.CLOSED)
        self.metrics.watch_ledger(self.ledger.count_by_state, live)
        self.channels = ChannelPool(config.worker_max_message_bytes, config.security)
        self._lost_listeners: list[WorkerLostListener] = []
        self._serving_listeners: list[ServingListener] = []
        self._serving = False

    def on_worker_lost(self, listener: WorkerLostListener) -> None:
        self._lost_listeners.append(listener)

    def on_serving_change(self, listener: ServingListener) -> None:
        self._serving_listeners.append(listener)

    @property
    def serving(self) -> bool:
        return self._serving

    def model_name(self) -> str:
        """The served model's name as the live workers report it ("" while none is live)."""
        workers = self.registry.alive()
        return workers[0].info.model.model_name if workers else ""

    async def worker_gone(self, record: WorkerRecord, *, expired: bool) -> None:
        """An incarnation died (lease) or was replaced: fail its requests, forget its state."""
        worker = WorkerRef(record.worker_id, record.epoch)
        if expired:
            self.metrics.worker_leases.labels(record.role, "expired").inc()
        self.ledger.drop_worker(worker)
        for listener in self._lost_listeners:
            listener(worker)
        # The channel goes only when no registered worker is at that address any more: a worker
        # back there, under this id or another (a restart with a new id on the same port, a
        # reused pod IP), has its calls on it.
        if not self.registry.uses_address(record.address):
            await self.channels.drop(record.address)
        await self.refresh()

    async def reap(self) -> list[WorkerRecord]:
        dead = self.registry.reap()
        for record in dead:
            await self.worker_gone(record, expired=True)
        if not dead:
            await self.refresh()
        return dead

    async def refresh(self) -> None:
        """Update gauges and tell listeners when the usable worker set appeared or vanished."""
        for role, workers in self.registry.alive_by_role().items():
            self.metrics.workers.labels(role).set(len(workers))
        serving = self.registry.has_serving_set()
        if serving != self._serving:
            self._serving = serving
            await asyncio.gather(*(listener(serving) for listener in self._serving_listeners))
