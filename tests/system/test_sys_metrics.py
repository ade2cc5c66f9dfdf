"""The metrics every process exports move exactly as the requests they served say.

A known set of requests (a shared prefix, so cached tokens > 0, and one rejected with a bad
argument) against a real system, disaggregated and colocated: the deltas of every scraped
/metrics endpoint match what the responses reported. Then no family any process exports may
be dead (never moved over the run).
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest
from metrics_harness import (
    ON_WORKER_LOSS_ONLY,
    UNDER_PRESSURE_ONLY,
    Scrape,
    dead_families,
    refuse_unauthenticated,
    run_known_requests,
    scrape_all,
)
from sys_harness import local_system, wait_until

from kvmesh.cli.up import LocalSystem
from kvmesh.client import Client, Result

PREFILL_BUSY = {"prefill/kvmesh:num_requests_running", "prefill/kvmesh:kv_cache_usage_perc"}
Expected = list[tuple[str, str, dict[str, str], float]]  # process, name, labels, delta


def expected_front_door(results: list[Result]) -> Expected:
    usages = [r.usage for r in results]
    assert all(u is not None for u in usages)
    n, tokens = len(results), sum(u.completion_tokens for u in usages if u)
    prompt = sum(u.prompt_tokens for u in usages if u)
    count = "_count"
    return [
        ("control", "kvmesh_control_requests_total", {"status": "OK"}, n),
        ("control", "kvmesh_control_requests_total", {"status": "INVALID_ARGUMENT"}, 1),
        ("control", "kvmesh:time_to_first_token_seconds" + count, {}, n),
        ("control", "kvmesh:e2e_request_latency_seconds" + count, {}, n),
        ("control", "kvmesh:request_queue_time_seconds" + count, {}, n),
        ("control", "kvmesh:request_prefill_time_seconds" + count, {}, n),
        ("control", "kvmesh:request_decode_time_seconds" + count, {}, n),
        ("control", "kvmesh:request_success_total", {"finished_reason": "length"}, n),
        ("control", "kvmesh:generation_tokens_total", {}, tokens),
        ("control", "kvmesh:prompt_tokens_total", {}, prompt),
        ("control", "kvmesh:request_generation_tokens_sum", {}, tokens),
        ("control", "kvmesh:request_prompt_tokens_sum", {}, prompt),
        ("control", "kvmesh:inter_token_latency_seconds" + count, {}, tokens - n),
        ("control", "kvmesh:time_per_output_token_seconds" + count, {}, n),
        ("control", "kvmesh_control_ttft_phase_seconds" + count, {"phase": "transfer"}, n),
    ]


def expected_engine(role: str, results: list[Result], decode_role: str) -> Expected:
    """The engine families of the worker that prefills (`role`) and the one that decodes."""
    usages = [r.usage for r in results if r.usage]
    cached = sum(u.cached_tokens for u in usages)
    assert cached >= 64, "the shared prefix was not served from the cache"
    computed = sum(u.prompt_tokens - u.cached_tokens for u in usages)
    decoded = sum(u.completion_tokens - 1 for u in usages)  # the first token is prefill's
    steps = [(role, computed), (decode_role, decoded)] if role != decode_role else []
    iteration = "kvmesh:iteration_tokens_total_sum"
    return [
        (role, "kvmesh:prefix_cache_hits_total", {}, cached),
        (role, "kvmesh:prefix_cache_queries_total", {}, sum(u.prompt_tokens for u in usages)),
        (role, "kvmesh_requests_total", {"status": "OK"}, len(usages)),
        (decode_role, "kvmesh_requests_total", {"status": "OK"}, len(usages)),
        *[(r, iteration, {}, tokens) for r, tokens in steps],
        *([(role, iteration, {}, computed + decoded)] if role == decode_role else []),
    ]


def check(before: dict[str, Scrape], after: dict[str, Scrape], expected: Expected) -> None:
    wrong = []
    for process, name, labels, delta in expected:
        got = after[process].total(name, **labels) - before[process].total(name, **labels)
        if got != pytest.approx(delta):
            wrong.append(f"{process} {name}{labels}: moved {got}, expected {delta}")
    assert not wrong, "\n".join(wrong)


def model_labels(scrapes: dict[str, Scrape], model: str) -> None:
    """Every `kvmesh:` sample carries model_name, the served model's name."""
    for process, s in scrapes.items():
        for name, labels in s.samples:
            if name.startswith("kvmesh:"):
                assert ("model_name", model) in labels, f"{process} {name}{labels}"


def mid_flight(system: LocalSystem, max_tokens: int) -> dict[str, Scrape]:
    """A scrape of every process while one long request streams (read to the end after)."""
    stream = Client(system.endpoint, timeout=60).generate(
        [40, 41, 42], max_tokens=max_tokens, ignore_eos=True, temperature=0.0
    )
    chunks = iter(stream)
    next(chunks)
    scrapes = scrape_all(system)
    for _ in chunks:
        pass
    return scrapes


@pytest.fixture(scope="module")
def colocated() -> Iterator[LocalSystem]:
    # A small pool and two sequences at most: three long requests wait and preempt.
    args = ("--num-kv-blocks", "12", "--max-num-seqs", "2")
    roles = {"prefill": 0, "decode": 0, "colocated": 1}
    with local_system(**roles, role_args={"colocated": args}) as started:
        yield started[0]


def test_disaggregated_metrics_match_the_responses(shm_system: tuple[LocalSystem, str]) -> None:
    system = shm_system[0]
    during = mid_flight(system, 600)
    assert during["decode"].total("kvmesh:num_requests_running") >= 1
    assert during["decode"].total("kvmesh:kv_cache_usage_perc") > 0
    assert during["control"].total("kvmesh_control_inflight") == 1
    assert during["control"].total("kvmesh_control_ledger_entries", state="DECODING") == 1
    before = scrape_all(system)
    results = run_known_requests(system)
    refuse_unauthenticated(system)
    after = scrape_all(system)
    blocks = sum(-(-r.usage.prompt_tokens // 16) for r in results if r.usage)
    check(before, after, [
        *expected_front_door(results),
        *expected_engine("prefill", results, "decode"),
        ("prefill", "kvmesh_kv_transfer_seconds_count", {"backend": "shm", "status": "OK"}, 4),
        ("decode", "kvmesh_reservation_leases_total", {"event": "granted"}, 4),
        ("control", "kvmesh_control_auth_refused_total", {"door": "internal"}, 1),
        ("prefill", "kvmesh_auth_refused_total", {}, 1),
        ("decode", "kvmesh_auth_refused_total", {}, 1),
    ])  # fmt: skip
    moved_bytes = after["prefill"].total("kvmesh_kv_transfer_bytes_total") - before[
        "prefill"
    ].total("kvmesh_kv_transfer_bytes_total")
    assert 0 < moved_bytes <= blocks * 64 * 1024, moved_bytes
    assert after["control"].total("kvmesh_control_ledger_entries") == 0
    assert after["control"].total("kvmesh_control_worker_leases_total", event="renewed") > 0
    model_labels(after, Client(system.endpoint).model_info().model_name)
    # A prefill worker holds a request for its prefill only: no scrape catches it busy.
    exempt = UNDER_PRESSURE_ONLY | ON_WORKER_LOSS_ONLY | PREFILL_BUSY
    history = {process: [during[process], after[process]] for process in after}
    assert dead_families(history, exempt) == []


def test_colocated_metrics_match_the_responses_and_none_is_dead(colocated: LocalSystem) -> None:
    during = pressure(colocated)
    before = scrape_all(colocated)
    assert before["colocated"].total("kvmesh:num_preemptions_total") >= 1
    results = run_known_requests(colocated)
    refuse_unauthenticated(colocated)
    after = scrape_all(colocated)
    check(before, after, [
        *expected_front_door(results),
        *expected_engine("colocated", results, "colocated"),
        ("colocated", "kvmesh_auth_refused_total", {}, 1),
    ])  # fmt: skip
    model_labels(after, Client(colocated.endpoint).model_info().model_name)
    history = {process: [*during[process], after[process]] for process in after}
    assert dead_families(history, ON_WORKER_LOSS_ONLY) == []


def pressure(system: LocalSystem) -> dict[str, list[Scrape]]:
    """Three long requests on two sequence slots and 12 blocks: one waits, two preempt each
    other; the scrapes taken until every gauge of every process moved."""
    client = Client(system.endpoint, timeout=120)
    pool = ThreadPoolExecutor(3)
    greedy = {"max_tokens": 150, "ignore_eos": True, "temperature": 0.0}
    prompts = [[100 + 20 * i + j for j in range(16)] for i in range(3)]
    results = [pool.submit(client.complete, prompt, **greedy) for prompt in prompts]
    history: dict[str, list[Scrape]] = {}

    def every_gauge_moved() -> bool:
        for process, s in scrape_all(system).items():
            history.setdefault(process, []).append(s)
        return not dead_families(history, set(), ("gauge",))

    try:
        wait_until(every_gauge_moved, 30, "every gauge moved (a request waiting for a slot)")
    finally:
        tokens = [len(future.result(timeout=120).token_ids) for future in results]
        pool.shutdown()
    assert tokens == [150] * 3
    return history
