"""Prefix caching in the loop and preemption by recompute under a tiny block pool."""

from __future__ import annotations

from scheduler_harness import (
    BLOCK_SIZE,
    make_scheduler,
    request,
    run_to_completion,
    sizes,
    step,
)

from kvmesh.engine.scheduler import Scheduler, SchedulerOutput
from kvmesh.engine.sequence import SequenceStatus


def position_tokens(sched: Scheduler, output: SchedulerOutput) -> dict[str, int]:
    """A fake model whose sampled token is the sequence's length: reveals lost or doubled ids."""
    sampled = {}
    for chunk in output.chunks:
        for seq_id in chunk.sample_seq_ids:
            seq = sched.state.seqs[seq_id]
            sampled[seq_id] = seq.num_prompt_tokens * 1000 + seq.num_tokens
    return sampled


def test_prefix_hit_skips_cached_tokens() -> None:
    sched, bm = make_scheduler(max_num_batched_tokens=64)
    shared = list(range(500, 510))  # two full blocks + 2 tokens
    sched.add_request(request("a", [*shared, 1, 2, 3]))
    first, _ = step(sched)
    sched.add_request(request("b", [*shared, 4, 5]))
    output, _ = step(sched)
    chunk_b = next(c for c in output.chunks if c.seq_id == "b")
    assert chunk_b.start_pos == 8 and chunk_b.token_ids == (508, 509, 4, 5)
    assert chunk_b.block_table[:2] == first.chunks[0].block_table[:2]
    assert sched.get_request("b").seqs[0].num_cached_tokens == 8  # type: ignore[union-attr]
    bm.check_integrity()


def test_whole_prompt_cached_still_computes_last_token() -> None:
    sched, _ = make_scheduler()
    prompt = list(range(900, 908))
    sched.add_request(request("c", prompt, max_tokens=1))
    step(sched)
    sched.add_request(request("d", prompt, max_tokens=1))
    (chunk,) = sched.schedule().chunks
    assert chunk.start_pos == 4 and chunk.token_ids == tuple(prompt[4:])


def test_commit_publishes_only_computed_blocks() -> None:
    sched, bm = make_scheduler(max_num_batched_tokens=6)
    prompt = list(range(300, 320))
    sched.add_request(request("a", prompt))
    output = sched.schedule()
    assert bm.metrics().cached_blocks == 0  # planned, not computed
    sched.update(output, {})
    assert bm.metrics().cached_blocks == 6 // BLOCK_SIZE
    step(sched)
    assert bm.metrics().cached_blocks == 12 // BLOCK_SIZE
    sched.schedule()  # plans tokens 12..18, never computed: the step is dropped
    sched.abort_request("a")
    sched.add_request(request("b", prompt))
    (chunk_b,) = sched.schedule().chunks
    assert chunk_b.start_pos == 12  # only computed blocks are visible to others
    bm.check_integrity()


def test_newest_running_is_preempted_to_front_and_resumes() -> None:
    sched, bm = make_scheduler(num_blocks=6, max_num_batched_tokens=64)
    for name in ("a", "b", "c"):
        sched.add_request(request(name, 4, max_tokens=10))
    output = sched.schedule()  # 3 blocks, one per prompt
    sched.update(output, position_tokens(sched, output))
    output = sched.schedule()  # each decode needs a 2nd block: only 3 free
    assert output.preempted_seq_ids == ()
    sched.update(output, position_tokens(sched, output))
    preempted_output = None
    for _ in range(4):
        output = sched.schedule()
        if output.preempted_seq_ids:
            preempted_output = output
            break
        sched.update(output, position_tokens(sched, output))
    assert preempted_output is not None
    assert preempted_output.preempted_seq_ids == ("c",)
    c = sched.state.waiting[0]
    assert c.seq_id == "c" and c.status is SequenceStatus.WAITING and c.num_computed_tokens == 0
    outputs_before = list(c.output_ids)
    assert outputs_before
    sched.update(preempted_output, position_tokens(sched, preempted_output))
    bm.check_integrity()
    resumed = None
    while sched.has_unfinished():
        output = sched.schedule()
        for chunk in output.chunks:
            if chunk.seq_id == "c" and chunk.start_pos == 0 and resumed is None:
                resumed = chunk
        sched.update(output, position_tokens(sched, output))
        bm.check_integrity()
    assert resumed is not None
    assert list(resumed.token_ids) == c.prompt_ids + outputs_before
    assert c.output_ids == [4004 + i for i in range(10)]  # one token per position, in order
    assert c.num_preemptions >= 1
    assert bm.num_free_blocks == 6


def test_preempted_sequences_keep_fcfs_order_at_the_front() -> None:
    sched, bm = make_scheduler(num_blocks=4, max_num_batched_tokens=64)
    for name in ("a", "b", "c", "d"):
        sched.add_request(request(name, 4, max_tokens=8))
    output, _ = step(sched)
    assert set(sizes(output)) == {"a", "b", "c", "d"}
    output = sched.schedule()  # every decode needs a new block, none free
    assert output.preempted_seq_ids == ("d", "c")
    assert [s.seq_id for s in sched.state.waiting] == ["c", "d"]
    assert sizes(output) == {"a": 1, "b": 1}
    bm.check_integrity()


def test_readmission_after_preemption_does_not_promote_its_own_blocks() -> None:
    """SLRU promotes a block when another request hits it. A sequence re-admitted after a
    recompute preemption hits the blocks it published itself: they stay probationary (a
    one-off prompt preempted under pressure must not end up protected); another request's
    hit still promotes them."""
    sched, bm = make_scheduler(num_blocks=64)
    prompt = list(range(700, 713))  # three full blocks and one token
    sched.add_request(request("solo", prompt, max_tokens=4))
    step(sched)  # the whole prompt: its three full blocks published
    published = bm.block_table("solo")[:3]
    sched.state.preempt(sched.state.seqs["solo"])  # by recompute, as under memory pressure
    step(sched)  # re-admitted: its lookup hits its own three blocks
    assert bm.block_table("solo")[:3] == published
    run_to_completion(sched)
    assert bm.metrics().protected_blocks == 0
    sched.add_request(request("other", prompt, max_tokens=1))
    run_to_completion(sched)
    assert bm.metrics().protected_blocks == 3
    bm.check_integrity()


def test_a_request_refused_admission_counts_one_prefix_query() -> None:
    """A waiting request that admission refuses (no blocks) is looked up again every step:
    the prefix metrics count it once, when it is admitted."""
    sched, bm = make_scheduler(num_blocks=8, max_num_batched_tokens=64)
    sched.add_request(request("big", 28, max_tokens=4))  # 7 of 8 blocks, then the 8th
    step(sched)
    sched.add_request(request("w", 8, max_tokens=1))  # needs 2 blocks: waits
    for _ in range(3):
        step(sched)
    assert sched.num_waiting == 1 and bm.metrics().prefix_queries == 1
    run_to_completion(sched)
    metrics = bm.metrics()
    assert (metrics.prefix_queries, metrics.prefix_query_tokens) == (2, 28 + 8)
    bm.check_integrity()
