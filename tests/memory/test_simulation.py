"""W2 memory simulation: hand-computed small scenarios, full-W2 targets, `kvmesh bench memory`."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvmesh.cli.main import main
from kvmesh.memory.sim_arena import ExtentArena
from kvmesh.memory.simulation import (
    W2_BUDGET,
    GreedyAdmission,
    SimRequest,
    SimulationError,
    WatermarkAdmission,
    run_w2,
    simulate_contiguous,
    simulate_paged,
    w2_requests,
)


def requests(*shapes: tuple[int, int]) -> list[SimRequest]:
    return [SimRequest(index, prompt, output) for index, (prompt, output) in enumerate(shapes)]


def test_arena_first_fit_and_coalescing() -> None:
    arena = ExtentArena(10)
    assert [arena.allocate(3), arena.allocate(4), arena.allocate(2)] == [0, 3, 7]
    arena.free(3, 4)
    assert arena.extents == ((3, 4), (9, 1))
    assert arena.allocate(5) is None
    assert arena.unusable_slots(5) == 5 and arena.unusable_slots(4) == 1
    assert arena.allocate(2) == 3
    arena.free(0, 3)
    assert arena.extents == ((0, 3), (5, 2), (9, 1))
    arena.free(3, 2)
    assert arena.extents == ((0, 7), (9, 1))
    arena.free(7, 2)
    assert arena.extents == ((0, 10),)
    assert arena.free_slots() == 10


def test_contiguous_reserves_max_len_and_refills_the_freed_extent() -> None:
    # budget 8 holds two 4-slot reservations; the third request waits one step for the second.
    result = simulate_contiguous(requests((1, 2), (2, 1), (1, 1)), budget=8, max_len=4)
    assert result.steps == 2
    assert result.peak_concurrency == 2 and result.mean_concurrency == 2
    assert result.utilization == pytest.approx((5 / 8 + 5 / 8) / 2)
    assert result.internal_fragmentation == pytest.approx((3 + 3) / 16)
    assert result.external_fragmentation == 0


def test_contiguous_exact_sizes_show_external_fragmentation() -> None:
    # A (4 slots) at 0, B (6) at 4 fill the arena; A leaves a 4-slot hole that C (5) cannot use
    # for two steps although B's end frees nothing until step 2.
    result = simulate_contiguous(requests((3, 1), (3, 3), (4, 1)), budget=10, max_len=None)
    assert result.steps == 4
    assert result.utilization == pytest.approx((8 / 10 + 5 / 6 + 1 + 1) / 4)
    assert result.kv_usage == pytest.approx((8 + 5 + 6 + 5) / 40)
    assert result.internal_fragmentation == pytest.approx((2 + 1) / 40)
    assert result.external_fragmentation == pytest.approx((0 + 4 + 4 + 0) / 40)
    assert (result.peak_concurrency, result.mean_concurrency) == (2, 1.25)


def test_paged_preempts_the_newest_and_recomputes_with_progress_kept() -> None:
    # 4 blocks of 2. Step 0: B's block preempts C. Step 2: A's block preempts B (4 tokens kept).
    # Step 3: B re-enters with 2 blocks and finishes; C re-enters and preempts itself.
    result = simulate_paged(
        requests((2, 3), (2, 3), (2, 1)), budget=8, block_size=2, admission=GreedyAdmission()
    )
    assert result.preemptions == 3
    assert result.steps == 5
    assert result.utilization == pytest.approx((6 / 8 + 8 / 8 + 5 / 6 + 5 / 6 + 3 / 4) / 5)
    assert result.kv_usage == pytest.approx((6 + 8 + 5 + 5 + 3) / 40)
    assert result.internal_fragmentation == pytest.approx((2 + 0 + 1 + 1 + 1) / 40)
    assert (result.peak_concurrency, result.mean_concurrency) == (2, 1.4)
    assert result.external_fragmentation == 0


def test_watermark_keeps_headroom_per_running_request() -> None:
    rule = WatermarkAdmission(headroom_tokens=24)
    # 3 running + newcomer: ceil(24 * 4 / 16) = 6 blocks of headroom.
    assert rule.allows(free_blocks=16, need_blocks=10, running=3, block_size=16)
    assert not rule.allows(free_blocks=15, need_blocks=10, running=3, block_size=16)
    assert rule.allows(free_blocks=10, need_blocks=10, running=0, block_size=16)
    assert GreedyAdmission().allows(free_blocks=10, need_blocks=10, running=3, block_size=16)


def test_watermark_admits_fewer_and_preempts_less_than_greedy() -> None:
    # C waits for headroom (1 + ceil(2 * 3 / 2) > 2 free blocks); A and B still outgrow the
    # pool at step 2 (B is preempted once), then B and C finish one after the other.
    shapes = requests((2, 3), (2, 3), (2, 1))
    watermark = simulate_paged(shapes, budget=8, block_size=2, admission=WatermarkAdmission(2))
    assert (watermark.preemptions, watermark.steps) == (1, 5)
    assert watermark.utilization == pytest.approx((6 / 8 + 1 + 5 / 6 + 5 / 6 + 3 / 4) / 5)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 40), st.integers(1, 40)), min_size=1, max_size=12))
def test_without_memory_pressure_everyone_runs_at_once(shapes: list[tuple[int, int]]) -> None:
    batch = requests(*shapes)
    longest = max(output for _, output in shapes)
    budget = 80 * len(shapes)
    for result in (
        simulate_contiguous(batch, budget=budget, max_len=80),
        simulate_paged(batch, budget=budget, block_size=8),
        simulate_paged(batch, budget=budget, block_size=4, admission=GreedyAdmission()),
    ):
        assert result.steps == longest
        assert result.peak_concurrency == len(shapes)
        assert result.preemptions == 0


@settings(max_examples=30, deadline=None)
@given(
    st.lists(st.tuples(st.integers(1, 30), st.integers(1, 30)), min_size=1, max_size=10),
    st.sampled_from([1, 2, 4, 8]),
)
def test_paged_under_pressure_still_finishes_everything(
    shapes: list[tuple[int, int]], block_size: int
) -> None:
    batch = requests(*shapes)
    budget = 64
    policy = GreedyAdmission()
    result = simulate_paged(batch, budget=budget, block_size=block_size, admission=policy)
    assert result.steps >= max(output for _, output in shapes)
    assert 0 < result.utilization <= 1 and result.kv_usage <= 1


def test_w2_requests_follow_the_workload() -> None:
    batch = w2_requests()
    assert len(batch) == 2000
    assert all(64 <= r.prompt_len <= 1024 and 64 <= r.output_len <= 1024 for r in batch)
    assert batch == w2_requests()
    assert batch[:5] != w2_requests(seed=1)[:5]


def test_full_w2_meets_the_paged_targets() -> None:
    results = run_w2(allocators=["contiguous", "paged-16", "paged-16-greedy"])
    contiguous, paged, greedy = results.values()
    assert contiguous.peak_concurrency == W2_BUDGET // 2048
    assert contiguous.utilization < 0.5
    assert paged.utilization >= 0.97
    assert paged.peak_concurrency >= 3 * contiguous.peak_concurrency
    assert paged.steps <= 0.5 * contiguous.steps
    assert paged.preemptions <= 0.1 * 2000
    assert greedy.preemptions >= 0.5 * 2000 > 5 * paged.preemptions


@pytest.mark.parametrize(
    ("call", "field"),
    [
        (lambda: SimRequest(0, 0, 5), "prompt_len"),
        (lambda: SimRequest(0, 5, -1), "output_len"),
        (lambda: simulate_contiguous(requests((30, 30)), budget=100, max_len=50), "total_len"),
        (lambda: simulate_contiguous(requests((3, 3)), budget=100, max_len=200), "max_len"),
        (lambda: simulate_paged(requests((60, 60)), budget=100, block_size=16), "total_len"),
        (lambda: simulate_paged(requests((6, 6)), budget=100, block_size=0), "block_size"),
        (lambda: run_w2(num_requests=5, allocators=["buddy"]), "allocators"),
        (lambda: w2_requests(0), "requests"),
    ],
)
def test_bad_input_names_its_field(call: object, field: str) -> None:
    with pytest.raises(SimulationError, match=rf"^{field}:"):
        call()  # type: ignore[operator]


def test_bench_memory_json(capsys: pytest.CaptureFixture) -> None:
    assert main(["bench", "memory", "--requests", "200", "--seed", "3", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert set(report) >= {"contiguous", "paged-8", "paged-16", "paged-32", "paged-16-greedy"}
    keys = {
        "utilization",
        "mean_concurrency",
        "peak_concurrency",
        "preemptions",
        "steps",
        "internal_fragmentation",
        "external_fragmentation",
    }
    assert all(keys <= set(metrics) for metrics in report.values())
    assert report["paged-16"]["utilization"] > report["contiguous"]["utilization"]
    assert report["paged-16"]["peak_concurrency"] > report["contiguous"]["peak_concurrency"]


def test_bench_memory_table_and_bad_input(capsys: pytest.CaptureFixture) -> None:
    assert main(["bench", "memory", "--requests", "100"]) == 0
    out = capsys.readouterr().out
    assert "paged-16-greedy" in out and "ratios vs contiguous" in out
    assert main(["bench", "memory", "--requests", "0"]) == 2
    assert capsys.readouterr().err.strip() == "kvmesh bench memory: requests: 0 must be positive"
