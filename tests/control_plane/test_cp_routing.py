"""Routing: prefix affinity, load balancing, decode capacity, layout compatibility."""

from __future__ import annotations

import pytest
from cp_fixtures import FakeClock, layout, load, worker_info

from control_plane.registry import Registry, WorkerRecord
from control_plane.routing import (
    NoRouteError,
    RoutingConfig,
    order_colocated,
    order_decode,
    order_pairs,
    order_prefill,
    prefix_key,
    text_prefix_key,
)


def records(*specs: tuple[str, str, int, int]) -> list[WorkerRecord]:
    """(id, role, free_blocks, queue) -> registered records."""
    registry = Registry(clock=FakeClock())
    for worker_id, role, free, queue in specs:
        registry.register(worker_info(worker_id, role), load(free=free, running=queue))
    return registry.alive()


PREFILLS = records(*[(f"p{i}", "prefill", 64, 0) for i in range(4)])


def test_same_prefix_goes_to_the_same_prefill_worker() -> None:
    config = RoutingConfig()
    prompt = [*range(16), 99]
    first = order_prefill(PREFILLS, prefix_key(prompt, 16, b""), config)[0]
    longer = order_prefill(PREFILLS, prefix_key([*prompt, 5, 6, 7], 16, b""), config)[0]
    assert first.worker_id == longer.worker_id


def test_prefixes_spread_over_workers_and_salt_changes_the_key() -> None:
    chosen = {
        order_prefill(PREFILLS, prefix_key([i] * 16, 16, b""), RoutingConfig())[0].worker_id
        for i in range(64)
    }
    assert len(chosen) == len(PREFILLS)
    assert prefix_key([1] * 16, 16, b"tenant-a") != prefix_key([1] * 16, 16, b"tenant-b")


def test_text_prompts_sharing_a_prefix_go_to_the_same_prefill_worker() -> None:
    """A text or chat prompt is routed before anyone tokenizes it: on its leading characters
    (a block's worth), so a shared system prompt keeps reaching the worker caching it."""
    system = "You are a careful assistant. Answer in one sentence, cite nothing. " * 2
    keys = {text_prefix_key(["system", system, "user", f"question {i}"], 16, b"") for i in range(8)}
    assert len(keys) == 1
    assert text_prefix_key([system + "a"], 16, b"") == text_prefix_key([system + "b"], 16, b"")
    assert text_prefix_key(["hi"], 16, b"") != text_prefix_key(["ho"], 16, b"")
    assert text_prefix_key(["ab", "c"], 16, b"") != text_prefix_key(["a", "bc"], 16, b"")
    assert text_prefix_key(["x"], 16, b"tenant-a") != text_prefix_key(["x"], 16, b"tenant-b")
    chosen = {
        order_prefill(PREFILLS, text_prefix_key([f"{i} " * 40], 16, b""), RoutingConfig())[0]
        for i in range(64)
    }
    assert len(chosen) == len(PREFILLS)


def test_overloaded_affine_worker_is_skipped_for_the_least_loaded() -> None:
    key = prefix_key([7] * 16, 16, b"")
    affine = order_prefill(PREFILLS, key, RoutingConfig())[0].worker_id
    specs = [(w.worker_id, "prefill", 64, 9 if w.worker_id == affine else 2) for w in PREFILLS]
    busy = records(*specs)
    assert order_prefill(busy, key, RoutingConfig(affinity_slack=10))[0].worker_id == affine
    chosen = order_prefill(busy, key, RoutingConfig(affinity_slack=4))[0]
    assert chosen.worker_id != affine and chosen.load.queue == 2


def test_decode_prefers_enough_free_blocks_then_most_free_then_fewest_running() -> None:
    decodes = records(("d0", "decode", 3, 0), ("d1", "decode", 20, 5), ("d2", "decode", 20, 1))
    assert [w.worker_id for w in order_decode(decodes, needed_blocks=4)] == ["d2", "d1", "d0"]
    tight = records(("d0", "decode", 3, 0), ("d1", "decode", 2, 0))
    assert [w.worker_id for w in order_decode(tight, needed_blocks=8)] == ["d0", "d1"]


def test_pairs_only_join_equal_layouts() -> None:
    registry = Registry(clock=FakeClock())
    registry.register(worker_info("p0", "prefill", kv_layout=layout(block_size=16)))
    registry.register(worker_info("p1", "prefill", kv_layout=layout(block_size=32)))
    registry.register(worker_info("d0", "decode", kv_layout=layout(block_size=32)))
    pairs = order_pairs(
        registry.alive("prefill"), registry.alive("decode"), [1, 2, 3], 8, b"", RoutingConfig()
    )
    assert [(p.worker_id, d.worker_id) for p, d in pairs] == [("p1", "d0")]


def test_layout_mismatch_everywhere_is_failed_precondition_naming_the_field() -> None:
    registry = Registry(clock=FakeClock())
    registry.register(worker_info("p0", "prefill", kv_layout=layout(dtype="float16")))
    registry.register(worker_info("d0", "decode", kv_layout=layout(dtype="float32")))
    with pytest.raises(NoRouteError, match="layout") as caught:
        order_pairs(
            registry.alive("prefill"), registry.alive("decode"), [1], 1, b"", RoutingConfig()
        )
    assert caught.value.code == "FAILED_PRECONDITION"


def test_missing_role_is_unavailable() -> None:
    with pytest.raises(NoRouteError, match="decode") as caught:
        order_pairs(PREFILLS, [], [1], 1, b"", RoutingConfig())
    assert caught.value.code == "UNAVAILABLE"


def test_colocated_workers_are_ordered_by_prefix_affinity_then_load() -> None:
    """Colocated routing is the prefill rule: a prompt's prefix keeps its worker (and that
    worker's prefix cache), prefixes spread over the workers, an overloaded one is skipped."""
    workers = records(*[(f"c{i}", "colocated", 64, 0) for i in range(4)])
    config = RoutingConfig()
    prompt = [*range(16), 3]
    first = order_colocated(workers, prompt, b"", config)[0]
    assert order_colocated(workers, [*prompt, 8, 9], b"", config)[0] is first
    spread = {order_colocated(workers, [i] * 16, b"", config)[0] for i in range(64)}
    assert len(spread) == len(workers)
    text = ["system", "Be brief. " * 20, "user", "hi"]
    assert (
        order_colocated(workers, [], b"", config, text=text)[0]
        is order_colocated(workers, [], b"", config, text=[*text[:3], "ho"])[0]
    )
    busy = records(*[(w.worker_id, "colocated", 64, 9 if w is first else 1) for w in workers])
    assert order_colocated(busy, prompt, b"", config)[0].worker_id != first.worker_id
    assert order_colocated([], prompt, b"", config) == []
