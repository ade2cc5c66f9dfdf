"""Worker registry: who is alive, in which role and incarnation, with what layout and load.

A worker is alive while heartbeats keep arriving within `lease_seconds`; `reap` removes the
ones whose lease lapsed. Registering again with a new epoch replaces the old incarnation (the
caller then fails the old incarnation's requests). The clock is injectable for tests.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from kvmesh.v1 import worker_pb2

ROLE_NAMES = {
    worker_pb2.WORKER_ROLE_PREFILL: "prefill",
    worker_pb2.WORKER_ROLE_DECODE: "decode",
    worker_pb2.WORKER_ROLE_COLOCATED: "colocated",
}


class RegistrationError(ValueError):
    """A RegisterRequest is unusable; the message starts with the offending field."""


@dataclass(frozen=True)
class Load:
    total_blocks: int = 0
    free_blocks: int = 0
    cached_blocks: int = 0
    running: int = 0
    waiting: int = 0

    @classmethod
    def from_proto(cls, load: worker_pb2.WorkerLoad) -> Load:
        return cls(
            load.total_blocks, load.free_blocks, load.cached_blocks, load.running, load.waiting
        )

    @property
    def queue(self) -> int:
        return self.running + self.waiting


@dataclass(eq=False)
class WorkerRecord:
    info: worker_pb2.WorkerInfo
    load: Load
    last_heartbeat: float

    @property
    def worker_id(self) -> str:
        return self.info.worker_id

    @property
    def epoch(self) -> int:
        return self.info.epoch

    @property
    def role(self) -> str:
        return ROLE_NAMES[self.info.role]

    @property
    def address(self) -> str:
        return self.info.address

    @property
    def layout(self) -> worker_pb2.KVCacheLayout:
        return self.info.layout


def validate_worker_info(info: worker_pb2.WorkerInfo) -> None:
    """Raise RegistrationError naming the first unusable field."""
    if not info.worker_id:
        raise RegistrationError("worker.worker_id must not be empty")
    if info.role not in ROLE_NAMES:
        raise RegistrationError(f"worker.role {info.role} is not prefill, decode or colocated")
    if not info.address:
        raise RegistrationError("worker.address must not be empty")
    if info.epoch == 0:
        raise RegistrationError("worker.epoch must be non-zero")
    if info.layout.block_size <= 0:
        raise RegistrationError("worker.layout.block_size must be positive")


class Registry:
    def __init__(self, lease_seconds: float = 3.0, clock: Callable[[], float] = time.monotonic):
        if lease_seconds <= 0:
            raise ValueError("lease_seconds must be positive")
        self.lease_seconds = lease_seconds
        self._clock = clock
        self._workers: dict[str, WorkerRecord] = {}

    def __len__(self) -> int:
        return len(self._workers)

    def register(
        self, info: worker_pb2.WorkerInfo, load: worker_pb2.WorkerLoad | None = None
    ) -> WorkerRecord | None:
        """Add or refresh a worker; returns the replaced incarnation when the epoch changed."""
        validate_worker_info(info)
        previous = self._workers.get(info.worker_id)
        record = WorkerRecord(
            _copy(info),
            Load.from_proto(load) if load is not None else Load(),
            self._clock(),
        )
        self._workers[info.worker_id] = record
        if previous is not None and previous.epoch != info.epoch:
            return previous
        return None

    def heartbeat(self, worker_id: str, epoch: int, load: worker_pb2.WorkerLoad) -> bool:
        """Renew the lease of a known incarnation; False when unknown (or another epoch)."""
        record = self._workers.get(worker_id)
        if record is None or record.epoch != epoch:
            return False
        record.load = Load.from_proto(load)
        record.last_heartbeat = self._clock()
        return True

    def get(self, worker_id: str) -> WorkerRecord | None:
        return self._workers.get(worker_id)

    def is_current(self, worker_id: str, epoch: int) -> bool:
        record = self._workers.get(worker_id)
        return record is not None and record.epoch == epoch

    def uses_address(self, address: str) -> bool:
        """Whether a registered worker (under any id, its lease lapsed or not) is at `address`."""
        return any(r.address == address for r in self._workers.values())

    def alive(self, role: str | None = None) -> list[WorkerRecord]:
        """Workers whose lease has not lapsed, optionally of one role, in id order."""
        now = self._clock()
        return [
            r
            for _, r in sorted(self._workers.items())
            if now - r.last_heartbeat <= self.lease_seconds and (role is None or r.role == role)
        ]

    def alive_by_role(self) -> dict[str, list[WorkerRecord]]:
        """Live workers of every role (roles without any map to []), each list in id order."""
        groups: dict[str, list[WorkerRecord]] = {role: [] for role in ROLE_NAMES.values()}
        for record in self.alive():
            groups[record.role].append(record)
        return groups

    def reap(self) -> list[WorkerRecord]:
        """Remove and return workers whose lease lapsed."""
        now = self._clock()
        dead = [r for r in self._workers.values() if now - r.last_heartbeat > self.lease_seconds]
        for record in dead:
            del self._workers[record.worker_id]
        return dead

    def remove(self, worker_id: str) -> WorkerRecord | None:
        return self._workers.pop(worker_id, None)

    def serving_set(self) -> tuple[str, list[WorkerRecord]] | None:
        """How requests can be served now, and by whom: "disaggregated" with the decode workers
        that have a prefill worker of equal layout, else "colocated" with the colocated
        workers; None when neither is live."""
        live = self.alive_by_role()
        paired = [d for d in live["decode"] if any(p.layout == d.layout for p in live["prefill"])]
        if paired:
            return "disaggregated", paired
        return ("colocated", live["colocated"]) if live["colocated"] else None

    def has_serving_set(self) -> bool:
        """A colocated worker, or a prefill and a decode worker with equal layouts."""
        return self.serving_set() is not None


def _copy(info: worker_pb2.WorkerInfo) -> worker_pb2.WorkerInfo:
    copied = worker_pb2.WorkerInfo()
    copied.CopyFrom(info)
    return copied
