"""scheduling_policy: decode-first vs prefill-first steps, the decode-stall bound, and the
scheduler's other features (preemption, prefix caching, chunking, forks, disaggregation
hooks) under prefill-first."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scheduler_harness import make_scheduler, request, run_to_completion, sizes, step

from kvmesh.engine.config import EngineConfig
from kvmesh.engine.errors import InvalidParameterError
from kvmesh.engine.scheduler import SchedulerConfig
from kvmesh.engine.sequence import SequenceStatus

PREFILL_FIRST = {"scheduling_policy": "prefill-first"}


def test_admission_step_holds_decodes_only_under_decode_first() -> None:
    expected = {"decode-first": {"a": 1, "b": 6}, "prefill-first": {"b": 6}}
    for policy, admission_step in expected.items():
        sched, bm = make_scheduler(max_num_batched_tokens=64, scheduling_policy=policy)
        sched.add_request(request("a", 8))
        step(sched)
        sched.add_request(request("b", 6))
        output, _ = step(sched)
        assert sizes(output) == admission_step, policy
        assert output.num_batched_tokens == sum(admission_step.values())
        assert sizes(step(sched)[0]) == {"a": 1, "b": 1}, policy  # no prompt work: decodes
        bm.check_integrity()


def test_chunked_prompt_alternates_with_decodes_at_the_stall_bound() -> None:
    """Budget 8, bound 8: a prompt-only chunk, then a decode-first step."""
    sched, _ = make_scheduler(max_num_batched_tokens=8, max_decode_stall_tokens=8, **PREFILL_FIRST)
    sched.add_request(request("a", 4, max_tokens=20))
    step(sched)
    sched.add_request(request("b", 20))
    seen = [sizes(step(sched)[0]) for _ in range(4)]
    assert seen == [{"b": 8}, {"a": 1, "b": 7}, {"b": 5}, {"a": 1, "b": 1}]


def test_stall_bound_counts_prompt_tokens_while_decodes_wait() -> None:
    """W3's pattern: a new request arrives as soon as the previous one has its first token."""
    sched, _ = make_scheduler(
        num_blocks=256, max_num_batched_tokens=64, max_decode_stall_tokens=12, **PREFILL_FIRST
    )
    sched.add_request(request("a", 4, max_tokens=50))
    step(sched)
    seen = []
    for index in range(8):
        sched.add_request(request(f"r{index}", 5, max_tokens=50))
        seen.append(sizes(step(sched)[0]))
    # 5 + 5 + 5 >= 12 prompt tokens while "a" waits: the next arrival shares a decode step
    decode_steps = [index for index, plan in enumerate(seen) if "a" in plan]
    assert decode_steps == [3, 7]
    assert seen[0] == {"r0": 5} and seen[3] == {"a": 1, "r0": 1, "r1": 1, "r2": 1, "r3": 5}


def test_waiting_request_that_cannot_be_admitted_does_not_stall_decodes() -> None:
    sched, _ = make_scheduler(max_num_seqs=1, **PREFILL_FIRST)
    sched.add_request(request("a", 4, max_tokens=3))
    step(sched)
    sched.add_request(request("b", 4, max_tokens=2))  # no seat until "a" finishes
    assert [sizes(step(sched)[0]) for _ in range(4)] == [{"a": 1}, {"a": 1}, {"b": 4}, {"b": 1}]


def test_prefix_hit_is_a_short_prompt_only_step() -> None:
    sched, bm = make_scheduler(max_num_batched_tokens=64, **PREFILL_FIRST)
    shared = list(range(500, 510))  # two full blocks of 4 + 2 tokens
    sched.add_request(request("a", [*shared, 1, 2, 3]))
    step(sched)
    sched.add_request(request("b", [*shared, 4, 5]))
    output, _ = step(sched)
    (chunk,) = output.chunks
    assert chunk.seq_id == "b" and chunk.start_pos == 8 and chunk.token_ids == (508, 509, 4, 5)
    bm.check_integrity()


def test_parallel_sampling_forks_in_a_prompt_only_step() -> None:
    sched, bm = make_scheduler(num_blocks=32, max_num_batched_tokens=64, **PREFILL_FIRST)
    sched.add_request(request("a", 4, max_tokens=4))
    step(sched)
    sched.add_request(request("r", 6, n=3, max_tokens=3))
    output, _ = step(sched)
    (chunk,) = output.chunks
    assert chunk.sample_seq_ids == ("r", "r#1", "r#2")
    assert sizes(step(sched)[0]) == {"a": 1, "r": 1, "r#1": 1, "r#2": 1}
    run_to_completion(sched)
    assert bm.num_free_blocks == 32
    bm.check_integrity()


def test_preempted_sequence_recomputes_in_a_prompt_only_step() -> None:
    sched, bm = make_scheduler(num_blocks=7, max_num_batched_tokens=64, **PREFILL_FIRST)
    lengths = {"a": 12, "b": 7, "c": 10}
    for name, max_tokens in lengths.items():
        sched.add_request(request(name, 4, max_tokens=max_tokens))
    finished, victims, recomputes = {}, set(), []
    while sched.has_unfinished():
        running = {s.seq_id for s in sched.state.running}
        output, changed = step(sched)
        planned = sizes(output)
        if any(planned.get(v, 0) > 1 for v in victims) and running - set(planned):
            recomputes.append(planned)  # a victim's recompute while others are running
        victims.update(output.preempted_seq_ids)
        finished.update({s.seq_id: s.output_ids for s in changed if s.status.is_finished})
        bm.check_integrity()
    assert sched.num_preemptions > 0 and recomputes
    assert all(len(plan) == 1 for plan in recomputes)  # the decodes waited
    assert finished == {name: [7] * max_tokens for name, max_tokens in lengths.items()}
    assert bm.num_free_blocks == 7


def test_disaggregation_hooks_under_prefill_first() -> None:
    sched, bm = make_scheduler(
        num_blocks=16, max_num_batched_tokens=4, max_decode_stall_tokens=4, **PREFILL_FIRST
    )
    assert bm.allocate("remote", 6) is not None
    assert (
        sched.add_prefilled_request(request("remote", 6, max_tokens=4), 6, first_tokens=[55]) == []
    )
    sched.add_request(request("p", 6, prefill_only=True))
    assert sizes(step(sched)[0]) == {"p": 4}  # the imported decode waits (4 >= bound 4)
    assert sizes(step(sched)[0]) == {"remote": 1, "p": 2}
    parked = sched.get_request("p")
    assert parked is not None and parked.seqs[0].status is SequenceStatus.PREFILLED
    assert sizes(step(sched)[0]) == {"remote": 1}
    sched.release_prefilled("p")
    run_to_completion(sched)
    assert bm.num_free_blocks == 16


def test_invalid_policy_and_bound_name_their_field() -> None:
    with pytest.raises(InvalidParameterError) as info:
        SchedulerConfig(max_model_len=64, scheduling_policy="sjf")
    assert info.value.field == "scheduling_policy"
    with pytest.raises(InvalidParameterError) as info:
        EngineConfig(scheduling_policy="prefill_first")
    assert info.value.field == "scheduling_policy" and "scheduling_policy" in str(info.value)
    for bad in (0, -3, 1.5, None):
        with pytest.raises(InvalidParameterError) as info:
            SchedulerConfig(max_model_len=64, max_decode_stall_tokens=bad)  # type: ignore[arg-type]
        assert info.value.field == "max_decode_stall_tokens"
        with pytest.raises(InvalidParameterError) as info:
            EngineConfig(max_decode_stall_tokens=bad)  # type: ignore[arg-type]
        assert info.value.field == "max_decode_stall_tokens"


ARRIVALS = st.lists(
    st.tuples(st.integers(1, 30), st.integers(1, 8), st.integers(0, 2)), min_size=1, max_size=12
)


@settings(max_examples=80, deadline=None)
@given(arrivals=ARRIVALS, budget=st.integers(4, 40), bound=st.integers(1, 50))
def test_prompt_only_steps_stop_at_the_bound(
    arrivals: list[tuple[int, int, int]], budget: int, bound: int
) -> None:
    """A step that leaves every decode-ready sequence out comes only while the prompt-only
    steps since a decode last ran computed fewer than `bound` tokens; everyone finishes with
    exactly max_tokens outputs (arrival i comes `gap` steps after arrival i - 1)."""
    sched, bm = make_scheduler(
        num_blocks=24,
        max_num_batched_tokens=budget,
        max_model_len=48,
        max_decode_stall_tokens=bound,
        **PREFILL_FIRST,
    )
    pending = list(enumerate(arrivals))
    countdown, stalled, finished = 0, 0, {}
    for _ in range(3000):
        while pending and countdown == 0:
            index, (prompt_len, max_tokens, countdown) = pending.pop(0)
            sched.add_request(request(f"r{index}", prompt_len, max_tokens=max_tokens))
        countdown -= 1 if countdown else 0
        if not pending and not sched.has_unfinished():
            break
        ready = {s.seq_id for s in sched.state.running if s.num_tokens - s.num_computed_tokens == 1}
        output, changed = step(sched)
        if ready and not ready & set(sizes(output)):
            assert stalled < bound, (stalled, bound)
            stalled += output.num_batched_tokens
        elif ready:
            stalled = 0
        finished.update({s.seq_id: len(s.output_ids) for s in changed if s.status.is_finished})
        bm.check_integrity()
    assert not pending and not sched.has_unfinished()
    assert finished == {
        f"r{index}": max_tokens for index, (_, max_tokens, _) in enumerate(arrivals)
    }
    assert bm.num_free_blocks == 24


def test_cli_flags_reach_the_engine_config() -> None:
    import argparse

    from kvmesh.cli import bench_throughput
    from kvmesh.service.options import parser

    args = parser("colocated").parse_args(["--scheduling-policy", "prefill-first"])
    assert args.scheduling_policy == "prefill-first"
    assert parser("decode").parse_args([]).scheduling_policy == "decode-first"
    bench = argparse.ArgumentParser().add_subparsers()
    bench_throughput.register(bench)
    throughput = bench.choices["throughput"]
    assert throughput.parse_args(["--scheduling-policy", "prefill-first"]).scheduling_policy == (
        "prefill-first"
    )
    assert throughput.parse_args([]).scheduling_policy is None  # the engine's default
    with pytest.raises(SystemExit):
        throughput.parse_args(["--scheduling-policy", "sjf"])
