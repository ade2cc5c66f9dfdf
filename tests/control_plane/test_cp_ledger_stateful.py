"""Hypothesis state machine: the ledger against a model of what workers really hold.

The "world" is the set of (worker, request id, generation) block sets the workers hold. Release
messages may be lost; heartbeats (`reconcile`) must then catch the leftovers. After every step:
no live entry is CLOSED, closed entries hold nothing, every world set is either held live by the
ledger or released by the worker's next heartbeat, and a heartbeat never releases a live set.
"""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from control_plane.ledger import (
    EntryState,
    HeldReport,
    IllegalTransition,
    Ledger,
    LedgerEntry,
    Release,
    StaleGeneration,
    WorkerRef,
)

IDS = st.sampled_from(["a", "b", "c", "d"])
PREFILLS = st.sampled_from([WorkerRef("p0", 1), WorkerRef("p1", 1)])
DECODES = st.sampled_from([WorkerRef("d0", 1), WorkerRef("d1", 1), WorkerRef("d0", 2)])
WORKERS = [WorkerRef("p0", 1), WorkerRef("p1", 1), WorkerRef("d0", 1), WorkerRef("d1", 1),
           WorkerRef("d0", 2)]  # fmt: skip


class LedgerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.ledger = Ledger(generation_base=0)
        self.world: set[tuple[WorkerRef, str, int]] = set()
        self.closed: list[LedgerEntry] = []

    def _live(self, rid: str, state: EntryState) -> LedgerEntry | None:
        if not self.ledger.is_live(rid):
            return None
        entry = self.ledger.get(rid)
        return entry if entry.state is state else None

    def _hold(self, worker: WorkerRef, rid: str, gen: int) -> None:
        """A worker holds at most one set per request id: a newer generation replaces it."""
        self.world = {(w, r, g) for (w, r, g) in self.world if (w, r) != (worker, rid)}
        self.world.add((worker, rid, gen))

    def _reports(self, worker: WorkerRef) -> list[HeldReport]:
        return [HeldReport(r, g) for (w, r, g) in self.world if w == worker]

    def _is_live(self, worker: WorkerRef, rid: str, gen: int) -> bool:
        if not self.ledger.is_live(rid):
            return False
        entry = self.ledger.get(rid)
        return entry.generation == gen and worker in entry.holdings

    @rule(rid=IDS)
    def open(self, rid: str) -> None:
        if not self.ledger.is_live(rid):
            self.ledger.open(rid, deadline=1e9)

    @rule(rid=IDS, worker=DECODES, blocks=st.integers(1, 8))
    def reserve(self, rid: str, worker: WorkerRef, blocks: int) -> None:
        entry = self._live(rid, EntryState.ROUTED)
        if entry is None:
            return
        self.ledger.expect(rid, entry.generation, worker)
        self._hold(worker, rid, entry.generation)
        self.ledger.reserved(rid, entry.generation, worker, blocks)

    @rule(rid=IDS, worker=DECODES, allocated=st.booleans(), deliver=st.booleans())
    def reserve_refused(self, rid: str, worker: WorkerRef, allocated: bool, deliver: bool) -> None:
        """A decode worker refuses the Reserve (maybe after allocating: its answer was lost)
        and leaves the entry; its Release may be lost too."""
        entry = self._live(rid, EntryState.ROUTED)
        if entry is None or worker in entry.holdings:
            return
        self.ledger.expect(rid, entry.generation, worker)
        if allocated:
            self._hold(worker, rid, entry.generation)
        release = self.ledger.refused(rid, entry.generation, worker)
        assert release == Release(worker, rid, entry.generation)
        assert worker not in self.ledger.holders(rid)
        if deliver:
            self.world.discard((worker, rid, entry.generation))

    @rule(rid=IDS, worker=PREFILLS)
    def prefill(self, rid: str, worker: WorkerRef) -> None:
        entry = self._live(rid, EntryState.RESERVED)
        if entry is None:
            return
        self.ledger.prefilling(rid, entry.generation, worker)
        self._hold(worker, rid, entry.generation)

    @rule(rid=IDS)
    def transfer(self, rid: str) -> None:
        entry = self._live(rid, EntryState.PREFILLING)
        if entry is None:
            return
        prefill = next(w for w in entry.holdings if w.worker_id.startswith("p"))
        self.world.discard((prefill, rid, entry.generation))  # freed on the acknowledgement
        self.ledger.transferred(rid, entry.generation, prefill)

    @rule(rid=IDS)
    def decode(self, rid: str) -> None:
        entry = self._live(rid, EntryState.TRANSFERRED)
        if entry is not None:
            self.ledger.decoding(rid, entry.generation)

    @rule(rid=IDS, deliver=st.booleans())
    def close(self, rid: str, deliver: bool) -> None:
        entry = self.ledger.get(rid) if self.ledger.is_live(rid) else None
        releases = self.ledger.close(rid, "finished")
        if entry is not None:
            self.closed.append(entry)
        if deliver:
            for release in releases:
                self.world.discard((release.worker, release.request_id, release.generation))

    @rule(rid=IDS, delta=st.sampled_from([-1, 1]))
    def stale_transition_is_refused(self, rid: str, delta: int) -> None:
        if not self.ledger.is_live(rid):
            return
        entry = self.ledger.get(rid)
        before = (entry.state, dict(entry.holdings))
        try:
            self.ledger.reserved(rid, entry.generation + delta, WorkerRef("d1", 1), 1)
        except StaleGeneration:
            pass
        else:
            raise AssertionError("a stale generation was accepted")
        assert (entry.state, dict(entry.holdings)) == before

    @rule(rid=IDS)
    def illegal_transition_is_refused(self, rid: str) -> None:
        entry = self._live(rid, EntryState.DECODING)
        if entry is None:
            return
        try:
            self.ledger.prefilling(rid, entry.generation, WorkerRef("p0", 1))
        except IllegalTransition:
            pass
        else:
            raise AssertionError("DECODING -> PREFILLING was accepted")

    @rule(worker=st.sampled_from(WORKERS))
    def heartbeat(self, worker: WorkerRef) -> None:
        released = set(self.ledger.reconcile(worker, self._reports(worker)))
        for w, r, g in self.world:
            if w == worker and r in released:
                assert not self._is_live(w, r, g), f"heartbeat released live set {r}"
        self.world = {(w, r, g) for (w, r, g) in self.world if w != worker or r not in released}

    @precondition(lambda self: self.world)
    @rule()
    def control_restart_adopts(self) -> None:
        self.ledger = Ledger(generation_base=1 << 40)
        self.closed = []
        for worker in WORKERS:
            reports = self._reports(worker)
            adopted = self.ledger.adopt(worker, reports)
            assert sorted(adopted) == sorted(r.request_id for r in reports)

    @invariant()
    def live_entries_are_not_closed(self) -> None:
        assert all(e.state is not EntryState.CLOSED for e in self.ledger.entries())

    @invariant()
    def closed_entries_hold_nothing(self) -> None:
        assert all(not e.holdings and e.state is EntryState.CLOSED for e in self.closed)

    @invariant()
    def every_held_set_is_live_or_scheduled_for_release(self) -> None:
        for worker in WORKERS:
            would_release = set(self.ledger.reconcile(worker, self._reports(worker)))
            for w, rid, gen in self.world:
                if w == worker:
                    assert self._is_live(w, rid, gen) != (rid in would_release)

    @invariant()
    def holders_match_the_state(self) -> None:
        for entry in self.ledger.entries():
            roles = {w.worker_id[0] for w in entry.holdings}
            assert self.ledger.holders(entry.request_id) == set(entry.holdings)
            if entry.state in (EntryState.RESERVED, EntryState.TRANSFERRED, EntryState.DECODING):
                assert roles == {"d"}
            if entry.state is EntryState.PREFILLING:
                assert roles == {"p", "d"}

    def teardown(self) -> None:
        for rid in [e.request_id for e in self.ledger.entries()]:
            self.ledger.close(rid, "shutdown")
        for worker in WORKERS:
            self.heartbeat(worker)
        assert self.world == set(), f"leaked block sets: {sorted(self.world)}"


TestLedgerMachine = LedgerMachine.TestCase
TestLedgerMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
