"""The block-ownership ledger: which worker holds which block set of each in-flight request.

Pure logic (no gRPC, no I/O). One entry per live request, moving through the states of
docs/PROTOCOL.md:

    ROUTED ──▶ RESERVED ──▶ PREFILLING ──▶ TRANSFERRED ──▶ DECODING ──▶ CLOSED
       └──────────────────────── (colocated) ─────────────────▶ DECODING
    any live state ──▶ CLOSED

Holders change with the state: a decode worker that refused its Reserve leaves the entry at
once (`refused`), the prefill worker leaves it at TRANSFERRED, so the holders are always the
workers whose loss can hurt the request now.

Every transition names the entry's generation; another generation raises `StaleGeneration`.
A worker is recorded as a holder *before* the call that may make it allocate, so a Release
reaches it even when that call is cancelled half-way. `close` returns every (worker,
generation) that must be sent a Release. Held sets a worker reports that the ledger does not
hold live are returned by `reconcile` for release.
"""

from __future__ import annotations

import enum
import itertools
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field


class EntryState(enum.Enum):
    ROUTED = "ROUTED"
    RESERVED = "RESERVED"
    PREFILLING = "PREFILLING"
    TRANSFERRED = "TRANSFERRED"
    DECODING = "DECODING"
    CLOSED = "CLOSED"


_NEXT: dict[EntryState, frozenset[EntryState]] = {
    EntryState.ROUTED: frozenset({EntryState.RESERVED, EntryState.DECODING, EntryState.CLOSED}),
    EntryState.RESERVED: frozenset({EntryState.PREFILLING, EntryState.CLOSED}),
    EntryState.PREFILLING: frozenset({EntryState.TRANSFERRED, EntryState.CLOSED}),
    EntryState.TRANSFERRED: frozenset({EntryState.DECODING, EntryState.CLOSED}),
    EntryState.DECODING: frozenset({EntryState.CLOSED}),
    EntryState.CLOSED: frozenset(),
}


class HoldState(enum.Enum):
    """What the ledger believes one worker holds for one request."""

    REQUESTED = "requested"  # a call that may allocate is in flight
    RESERVED = "reserved"
    FILLING = "filling"
    FILLED = "filled"
    RUNNING = "running"


class LedgerError(Exception):
    """Base of the ledger's typed errors (a request id the ledger cannot take now)."""

    status_name = "ALREADY_EXISTS"  # the gRPC status the request ends with


class UnknownRequest(LedgerError):
    """No live entry has this request id."""


class DuplicateRequest(LedgerError):
    """A live entry already has this request id."""


class StaleGeneration(LedgerError):
    """The caller named a generation other than the entry's current one."""


class IllegalTransition(LedgerError):
    """The state machine does not allow this transition."""


@dataclass(frozen=True, order=True)
class WorkerRef:
    worker_id: str
    epoch: int


@dataclass
class Holding:
    state: HoldState
    num_blocks: int
    lease_deadline: float


@dataclass(frozen=True)
class HeldReport:
    """One block set a worker says it holds (HeldBlockSet without the proto)."""

    request_id: str
    generation: int
    num_blocks: int = 0


@dataclass(frozen=True)
class Release:
    worker: WorkerRef
    request_id: str
    generation: int


@dataclass
class LedgerEntry:
    request_id: str
    generation: int
    state: EntryState
    created_at: float
    deadline: float
    holdings: dict[WorkerRef, Holding] = field(default_factory=dict)

    @property
    def live(self) -> bool:
        return self.state is not EntryState.CLOSED


def default_generation_base() -> int:
    """Start of this incarnation's generations: wall-clock milliseconds shifted past the counter.

    Generations stay increasing across control-plane restarts while clocks move forward.
    """
    return (time.time_ns() // 1_000_000) << 20


class Ledger:
    """Entries of live requests plus a bounded history of recently closed ids."""

    def __init__(
        self,
        clock: Callable[[], float] = time.monotonic,
        history_size: int = 4096,
        generation_base: int | None = None,
        reservation_lease: float = 30.0,
    ) -> None:
        self._clock = clock
        self._history_size = history_size
        base = default_generation_base() if generation_base is None else generation_base
        self._generations = itertools.count(base + 1)
        self._reservation_lease = reservation_lease
        self._entries: dict[str, LedgerEntry] = {}
        self._closed: OrderedDict[str, str] = OrderedDict()
        # Held sets reported by workers that no live entry owns: scheduled for release.
        self._orphans: dict[WorkerRef, dict[str, int]] = {}

    # -- queries ---------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, request_id: str) -> LedgerEntry:
        entry = self._entries.get(request_id)
        if entry is None:
            raise UnknownRequest(f"request_id {request_id!r} has no live entry")
        return entry

    def is_live(self, request_id: str) -> bool:
        return request_id in self._entries

    def closed_outcome(self, request_id: str) -> str | None:
        """The outcome of a recently closed request, or None when not in the history."""
        return self._closed.get(request_id)

    def entries(self) -> list[LedgerEntry]:
        return list(self._entries.values())

    def count_by_state(self) -> dict[str, int]:
        """Live entries per state name (safe from another thread: counts a copy)."""
        counts: dict[str, int] = {}
        for entry in self.entries():
            counts[entry.state.name] = counts.get(entry.state.name, 0) + 1
        return counts

    def holders(self, request_id: str) -> frozenset[WorkerRef]:
        """Worker incarnations that hold (or may hold) blocks of the live entry; empty when
        the request has no live entry."""
        entry = self._entries.get(request_id)
        return frozenset(entry.holdings) if entry is not None else frozenset()

    def entries_of(self, worker_id: str) -> list[LedgerEntry]:
        """Live entries in which any incarnation of `worker_id` holds (or may hold) blocks."""
        return [
            e for e in self._entries.values() if any(w.worker_id == worker_id for w in e.holdings)
        ]

    def orphans(self) -> dict[WorkerRef, dict[str, int]]:
        return {w: dict(sets) for w, sets in self._orphans.items()}

    # -- transitions -----------------------------------------------------------------------

    def open(self, request_id: str, deadline: float) -> LedgerEntry:
        """A new entry in ROUTED with a fresh generation."""
        if request_id in self._entries:
            raise DuplicateRequest(f"request_id {request_id!r} is already running")
        self._closed.pop(request_id, None)
        now = self._clock()
        entry = LedgerEntry(request_id, next(self._generations), EntryState.ROUTED, now, deadline)
        self._entries[request_id] = entry
        return entry

    def expect(self, request_id: str, generation: int, worker: WorkerRef) -> None:
        """Record `worker` as a possible holder before a call that may allocate there."""
        entry = self._checked(request_id, generation)
        entry.holdings.setdefault(
            worker, Holding(HoldState.REQUESTED, 0, self._lease_deadline(entry))
        )

    def refused(self, request_id: str, generation: int, worker: WorkerRef) -> Release:
        """`worker` refused the call it was expected for and leaves the entry.

        Only a REQUESTED holding may leave this way (IllegalTransition otherwise). The returned
        Release is best effort: a set the worker holds anyway (a reply lost on the way) is no
        longer live here, so its next heartbeat is told to free it.
        """
        entry = self._checked(request_id, generation)
        holding = entry.holdings.get(worker)
        if holding is None or holding.state is not HoldState.REQUESTED:
            state = "no holding" if holding is None else holding.state.value
            raise IllegalTransition(f"{request_id!r}: {worker} cannot refuse ({state})")
        del entry.holdings[worker]
        return Release(worker, request_id, generation)

    def reserved(self, request_id: str, generation: int, decode: WorkerRef, blocks: int) -> None:
        entry = self._advance(request_id, generation, EntryState.RESERVED)
        entry.holdings[decode] = Holding(HoldState.RESERVED, blocks, self._lease_deadline(entry))

    def prefilling(self, request_id: str, generation: int, prefill: WorkerRef) -> None:
        entry = self._advance(request_id, generation, EntryState.PREFILLING)
        entry.holdings[prefill] = Holding(HoldState.FILLING, 0, entry.deadline)

    def transferred(self, request_id: str, generation: int, prefill: WorkerRef) -> None:
        """KV landed on the decode side; the prefill worker freed its own set on the decode
        side's acknowledgement, so its holding is dropped."""
        entry = self._advance(request_id, generation, EntryState.TRANSFERRED)
        entry.holdings.pop(prefill, None)
        for holding in entry.holdings.values():
            if holding.state is HoldState.RESERVED:
                holding.state = HoldState.FILLED

    def decoding(self, request_id: str, generation: int, worker: WorkerRef | None = None) -> None:
        """Decode started (or, from ROUTED, a colocated worker took the whole request)."""
        entry = self._checked(request_id, generation)
        if entry.state is EntryState.ROUTED:
            if worker is None:
                raise IllegalTransition("colocated DECODING from ROUTED needs the worker")
            entry.holdings[worker] = Holding(HoldState.RUNNING, 0, entry.deadline)
        entry = self._advance(request_id, generation, EntryState.DECODING)
        for holding in entry.holdings.values():
            holding.state = HoldState.RUNNING
            holding.lease_deadline = entry.deadline

    def close(self, request_id: str, outcome: str, generation: int | None = None) -> list[Release]:
        """Close a live entry; returns the Release every (possible) holder must receive.

        Closing an id that is not live only records the outcome and returns [] (idempotent).
        """
        entry = self._entries.get(request_id)
        if entry is None:
            self._remember(request_id, outcome)
            return []
        if generation is not None:
            _check_generation(entry, generation)
        del self._entries[request_id]
        entry.state = EntryState.CLOSED
        releases = [Release(w, request_id, entry.generation) for w in sorted(entry.holdings)]
        entry.holdings.clear()
        self._remember(request_id, outcome)
        return releases

    # -- worker reports --------------------------------------------------------------------

    def reconcile(self, worker: WorkerRef, held: Iterable[HeldReport]) -> list[str]:
        """Request ids `worker` must release: every reported set the ledger does not hold live
        for exactly this worker incarnation and generation. Renews the leases of the others."""
        release: list[str] = []
        reported: dict[str, int] = {}
        for report in held:
            reported[report.request_id] = report.generation
            holding = self._live_holding(worker, report)
            if holding is None:
                release.append(report.request_id)
            elif holding.state is not HoldState.RUNNING:
                holding.lease_deadline = self._lease_deadline(self._entries[report.request_id])
        self._forget_released_orphans(worker, reported)
        return release

    def adopt(self, worker: WorkerRef, held: Iterable[HeldReport]) -> list[str]:
        """Record sets reported at (re-)registration that no live entry owns, as orphans
        scheduled for release; returns their request ids."""
        orphaned = [r for r in held if self._live_holding(worker, r) is None]
        if orphaned:
            sets = self._orphans.setdefault(worker, {})
            sets.update({r.request_id: r.generation for r in orphaned})
        return [r.request_id for r in orphaned]

    def drop_worker(self, worker: WorkerRef) -> None:
        """Forget orphans of a dead incarnation (its memory is gone with it)."""
        self._orphans.pop(worker, None)

    # -- internals -------------------------------------------------------------------------

    def _live_holding(self, worker: WorkerRef, report: HeldReport) -> Holding | None:
        entry = self._entries.get(report.request_id)
        if entry is None or entry.generation != report.generation:
            return None
        return entry.holdings.get(worker)

    def _forget_released_orphans(self, worker: WorkerRef, reported: dict[str, int]) -> None:
        sets = self._orphans.get(worker)
        if not sets:
            return
        for request_id in [r for r, g in sets.items() if reported.get(r) != g]:
            del sets[request_id]
        if not sets:
            del self._orphans[worker]

    def _checked(self, request_id: str, generation: int) -> LedgerEntry:
        entry = self.get(request_id)
        _check_generation(entry, generation)
        return entry

    def _advance(self, request_id: str, generation: int, to: EntryState) -> LedgerEntry:
        entry = self._checked(request_id, generation)
        if to not in _NEXT[entry.state] or to is EntryState.CLOSED:
            raise IllegalTransition(f"{request_id!r}: {entry.state.value} -> {to.value}")
        entry.state = to
        return entry

    def _lease_deadline(self, entry: LedgerEntry) -> float:
        return min(entry.deadline, self._clock() + self._reservation_lease)

    def _remember(self, request_id: str, outcome: str) -> None:
        self._closed[request_id] = outcome
        self._closed.move_to_end(request_id)
        while len(self._closed) > self._history_size:
            self._closed.popitem(last=False)


def _check_generation(entry: LedgerEntry, generation: int) -> None:
    if generation != entry.generation:
        raise StaleGeneration(
            f"generation {generation} is stale for {entry.request_id!r} (now {entry.generation})"
        )
