"""Abort frees everything at every moment; random operation sequences keep the pool intact."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from scheduler_harness import fake_tokens, make_scheduler, request, step

from kvmesh.engine.scheduler import SCHEDULING_POLICIES
from kvmesh.engine.sequence import SequenceStatus


def test_abort_mid_prefill_waiting_and_preempted_frees_everything() -> None:
    sched, bm = make_scheduler(num_blocks=8, max_num_batched_tokens=6)
    sched.add_request(request("long", 20, max_tokens=4))
    sched.add_request(request("wait", 4, max_tokens=4))
    output = sched.schedule()
    assert [c.seq_id for c in output.chunks] == ["long"]
    sched.update(output, fake_tokens(output))
    assert bm.num_free_blocks < 8
    (long_seq,) = sched.abort_request("long")
    assert long_seq.status is SequenceStatus.FINISHED_ABORTED
    assert long_seq.finish_reason == "abort"
    (wait_seq,) = sched.abort_request("wait")
    assert wait_seq.status is SequenceStatus.FINISHED_ABORTED
    assert sched.abort_request("wait") == []  # idempotent
    assert not sched.has_unfinished() and bm.num_free_blocks == 8
    bm.check_integrity()


def test_abort_between_schedule_and_update_skips_the_chunk() -> None:
    sched, bm = make_scheduler(num_blocks=16)
    sched.add_request(request("a", 6))
    sched.add_request(request("b", 6))
    output = sched.schedule()
    sched.abort_request("a")
    changed = sched.update(output, fake_tokens(output))
    assert [s.seq_id for s in changed] == ["b"]
    sched.abort_request("b")
    assert bm.num_free_blocks == 16
    bm.check_integrity()


OPS = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.integers(1, 30), st.integers(1, 12), st.integers(1, 3)),
        st.tuples(st.just("step"), st.integers(0, 9)),
        st.tuples(st.just("plan_abort"), st.integers(0, 30)),
        st.tuples(st.just("abort"), st.integers(0, 30)),
    ),
    max_size=40,
)


@settings(max_examples=150, deadline=None)
@given(
    ops=OPS,
    chunked=st.booleans(),
    caching=st.booleans(),
    policy=st.sampled_from(SCHEDULING_POLICIES),
)
def test_random_operations_keep_block_accounting(
    ops: list[tuple], chunked: bool, caching: bool, policy: str
) -> None:
    sched, bm = make_scheduler(
        num_blocks=12,
        max_num_seqs=4,
        max_num_batched_tokens=48 if chunked else 64,
        max_model_len=48,
        enable_chunked_prefill=chunked,
        enable_prefix_caching=caching,
        scheduling_policy=policy,
    )
    ids: list[str] = []
    for op in ops:
        if op[0] == "add":
            _, prompt_len, max_tokens, n = op
            request_id = f"r{len(ids)}"
            prompt = [10 + (i % 7) for i in range(prompt_len)]  # shared prefixes
            sched.add_request(request(request_id, prompt, max_tokens=max_tokens, n=n))
            ids.append(request_id)
        elif op[0] == "step":
            step(sched, token=op[1])
        elif op[0] == "plan_abort" and ids:
            output = sched.schedule()
            sched.abort_request(ids[op[1] % len(ids)])
            sched.update(output, fake_tokens(output))
        elif op[0] == "abort" and ids:
            sched.abort_request(ids[op[1] % len(ids)])
        bm.check_integrity()
        assert sched.num_running <= 4 + 2  # n > 1 children join after their fork
    for request_id in ids:
        sched.abort_request(request_id)
    bm.check_integrity()
    assert bm.num_free_blocks == bm.num_blocks
    assert not sched.has_unfinished()


@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(st.tuples(st.integers(1, 30), st.integers(1, 10)), min_size=1, max_size=8),
    policy=st.sampled_from(SCHEDULING_POLICIES),
)
def test_every_request_finishes_with_exact_length_under_pressure(
    lengths: list[tuple[int, int]], policy: str
) -> None:
    sched, bm = make_scheduler(
        num_blocks=10, max_num_batched_tokens=16, max_model_len=40, scheduling_policy=policy
    )
    for index, (prompt_len, max_tokens) in enumerate(lengths):
        sched.add_request(request(f"r{index}", prompt_len, max_tokens=max_tokens))
    finished = {}
    for _ in range(2000):
        if not sched.has_unfinished():
            break
        _, changed = step(sched)
        bm.check_integrity()
        finished.update({s.seq_id: s for s in changed if s.status.is_finished})
    assert not sched.has_unfinished()
    for index, (_, max_tokens) in enumerate(lengths):
        assert finished[f"r{index}"].output_ids == [7] * max_tokens
    assert bm.num_free_blocks == 10
