"""Ledger unit tests: transitions, fencing, releases, history, reconcile and adoption."""

from __future__ import annotations

import pytest

from control_plane.ledger import (
    DuplicateRequest,
    EntryState,
    HeldReport,
    IllegalTransition,
    Ledger,
    Release,
    StaleGeneration,
    UnknownRequest,
    WorkerRef,
)

P = WorkerRef("p0", 11)
D = WorkerRef("d0", 22)


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def full_path(ledger: Ledger, request_id: str = "r1") -> int:
    gen = ledger.open(request_id, deadline=1e9).generation
    ledger.expect(request_id, gen, D)
    ledger.reserved(request_id, gen, D, blocks=4)
    ledger.prefilling(request_id, gen, P)
    ledger.transferred(request_id, gen, P)
    ledger.decoding(request_id, gen)
    return gen


def test_generations_increase_and_differ_between_incarnations() -> None:
    first = Ledger(generation_base=1000)
    gens = [first.open(f"r{i}", 1e9).generation for i in range(3)]
    assert gens == sorted(gens) and len(set(gens)) == 3
    second = Ledger(generation_base=5000)
    assert second.open("r0", 1e9).generation > max(gens)


def test_happy_path_reaches_decoding_and_close_releases_decode_only() -> None:
    ledger = Ledger()
    gen = full_path(ledger)
    entry = ledger.get("r1")
    assert entry.state is EntryState.DECODING
    assert set(entry.holdings) == {D}
    assert ledger.close("r1", "finished") == [Release(D, "r1", gen)]
    assert len(ledger) == 0
    assert entry.holdings == {} and entry.state is EntryState.CLOSED
    assert ledger.closed_outcome("r1") == "finished"


def test_close_mid_prefill_releases_both_sides() -> None:
    ledger = Ledger()
    gen = ledger.open("r", 1e9).generation
    ledger.reserved("r", gen, D, 2)
    ledger.prefilling("r", gen, P)
    releases = ledger.close("r", "cancelled")
    assert {r.worker for r in releases} == {P, D}
    assert all(r.generation == gen for r in releases)


def test_expected_holder_is_released_even_before_its_call_answered() -> None:
    ledger = Ledger()
    gen = ledger.open("r", 1e9).generation
    ledger.expect("r", gen, D)
    assert ledger.close("r", "cancelled") == [Release(D, "r", gen)]


def test_illegal_transitions_raise_typed_errors() -> None:
    ledger = Ledger()
    gen = ledger.open("r", 1e9).generation
    with pytest.raises(IllegalTransition):
        ledger.prefilling("r", gen, P)
    with pytest.raises(IllegalTransition):
        ledger.transferred("r", gen, P)
    with pytest.raises(IllegalTransition):
        ledger.decoding("r", gen)  # from ROUTED only with a colocated worker
    ledger.reserved("r", gen, D, 1)
    with pytest.raises(IllegalTransition):
        ledger.reserved("r", gen, D, 1)
    assert ledger.get("r").state is EntryState.RESERVED


def test_stale_generation_is_refused_everywhere() -> None:
    ledger = Ledger()
    gen = ledger.open("r", 1e9).generation
    with pytest.raises(StaleGeneration):
        ledger.reserved("r", gen + 1, D, 1)
    with pytest.raises(StaleGeneration):
        ledger.close("r", "x", generation=gen - 1)
    assert ledger.is_live("r")


def test_unknown_and_duplicate_ids() -> None:
    ledger = Ledger()
    with pytest.raises(UnknownRequest):
        ledger.reserved("nope", 1, D, 1)
    ledger.open("r", 1e9)
    with pytest.raises(DuplicateRequest):
        ledger.open("r", 1e9)
    assert ledger.close("nope", "x") == []


def test_colocated_goes_from_routed_to_decoding() -> None:
    ledger = Ledger()
    gen = ledger.open("r", 1e9).generation
    worker = WorkerRef("c0", 5)
    ledger.decoding("r", gen, worker)
    assert ledger.close("r", "finished") == [Release(worker, "r", gen)]


def test_history_is_bounded_and_reopen_forgets_the_old_outcome() -> None:
    ledger = Ledger(history_size=2)
    for rid in ("a", "b", "c"):
        ledger.open(rid, 1e9)
        ledger.close(rid, "finished")
    assert ledger.closed_outcome("a") is None
    assert ledger.closed_outcome("c") == "finished"
    ledger.open("c", 1e9)
    assert ledger.closed_outcome("c") is None


def test_reconcile_keeps_live_sets_and_releases_everything_else() -> None:
    ledger = Ledger()
    gen = ledger.open("live", 1e9).generation
    ledger.reserved("live", gen, D, 3)
    held = [
        HeldReport("live", gen, 3),
        HeldReport("live", gen - 1, 3),  # older generation
        HeldReport("ghost", 7, 1),  # unknown
    ]
    assert ledger.reconcile(D, held) == ["live", "ghost"]
    # Same worker id, another incarnation: nothing it holds is live.
    assert ledger.reconcile(WorkerRef(D.worker_id, D.epoch + 1), [HeldReport("live", gen)]) == [
        "live"
    ]
    ledger.close("live", "finished")
    assert ledger.reconcile(D, [HeldReport("live", gen, 3)]) == ["live"]


def test_reconcile_renews_reservation_leases() -> None:
    clock = FakeClock()
    ledger = Ledger(clock=clock, reservation_lease=5.0)
    gen = ledger.open("r", deadline=1e9).generation
    ledger.reserved("r", gen, D, 1)
    assert ledger.get("r").holdings[D].lease_deadline == 105.0
    clock.now = 103.0
    ledger.reconcile(D, [HeldReport("r", gen, 1)])
    assert ledger.get("r").holdings[D].lease_deadline == 108.0


def test_lease_never_passes_the_request_deadline() -> None:
    ledger = Ledger(clock=FakeClock(), reservation_lease=30.0)
    gen = ledger.open("r", deadline=110.0).generation
    ledger.reserved("r", gen, D, 1)
    assert ledger.get("r").holdings[D].lease_deadline == 110.0


def test_adopted_sets_are_recorded_then_released_and_forgotten() -> None:
    ledger = Ledger()
    reports = [HeldReport("old1", 3, 2), HeldReport("old2", 4, 1)]
    assert ledger.adopt(D, reports) == ["old1", "old2"]
    assert ledger.orphans() == {D: {"old1": 3, "old2": 4}}
    assert ledger.reconcile(D, reports) == ["old1", "old2"]
    assert ledger.reconcile(D, reports[1:]) == ["old2"]
    assert ledger.orphans() == {D: {"old2": 4}}
    ledger.reconcile(D, [])
    assert ledger.orphans() == {}


def test_entries_of_finds_every_incarnation_of_a_worker() -> None:
    ledger = Ledger()
    full_path(ledger, "a")
    gen = ledger.open("b", 1e9).generation
    ledger.expect("b", gen, WorkerRef("d0", 99))
    ledger.open("c", 1e9)
    assert sorted(e.request_id for e in ledger.entries_of("d0")) == ["a", "b"]
    assert ledger.entries_of("p0") == []  # transferred: the prefill side holds nothing


def test_a_refusing_decode_worker_leaves_the_entry_and_is_released() -> None:
    ledger = Ledger()
    other = WorkerRef("d1", 33)
    gen = ledger.open("r", 1e9).generation
    ledger.expect("r", gen, D)
    assert ledger.refused("r", gen, D) == Release(D, "r", gen)
    assert ledger.holders("r") == frozenset()
    ledger.expect("r", gen, other)
    ledger.reserved("r", gen, other, 2)
    ledger.prefilling("r", gen, P)
    assert ledger.holders("r") == {other, P}
    ledger.transferred("r", gen, P)
    assert ledger.holders("r") == {other}  # a finished prefill worker is no longer a holder
    assert ledger.close("r", "finished") == [Release(other, "r", gen)]
    assert ledger.holders("r") == frozenset()
    # A set the refusing worker holds anyway (its answer was lost) is released by heartbeat.
    assert ledger.reconcile(D, [HeldReport("r", gen)]) == ["r"]


def test_only_a_requested_holding_may_refuse() -> None:
    ledger = Ledger()
    gen = ledger.open("r", 1e9).generation
    with pytest.raises(IllegalTransition):
        ledger.refused("r", gen, D)  # never expected
    ledger.expect("r", gen, D)
    ledger.reserved("r", gen, D, 2)
    with pytest.raises(IllegalTransition):
        ledger.refused("r", gen, D)  # it holds the reservation now
    with pytest.raises(StaleGeneration):
        ledger.refused("r", gen + 1, D)
    assert ledger.holders("r") == {D} and ledger.get("r").state is EntryState.RESERVED
