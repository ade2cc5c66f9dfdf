"""Parallel sampling (n > 1) forks after prefill; static and contiguous baselines."""

from __future__ import annotations

import pytest
from scheduler_harness import make_scheduler, request, run_to_completion, sizes, step

from kvmesh.engine.errors import InvalidParameterError


def test_n_children_fork_at_final_prefill_chunk_and_share_blocks() -> None:
    sched, bm = make_scheduler(num_blocks=32, max_num_batched_tokens=4)
    sched.add_request(request("r", 6, n=3, max_tokens=3))
    first, _ = step(sched)
    assert first.chunks[0].sample_seq_ids == ()
    final = sched.schedule()
    (chunk,) = final.chunks
    assert chunk.sample_seq_ids == ("r", "r#1", "r#2")
    table = chunk.block_table
    assert all(bm.ref_count(block) == 3 for block in table)
    assert bm.num_free_blocks == 32 - len(table)  # shared, not copied
    sched.update(final, {"r": 1, "r#1": 2, "r#2": 3})
    request_obj = sched.get_request("r")
    assert request_obj is not None
    assert [s.output_ids for s in request_obj.seqs] == [[1], [2], [3]]
    decode = sched.schedule()
    assert sizes(decode) == {"r": 1, "r#1": 1, "r#2": 1}
    # the partly filled last block is shared: every writer gets a private copy
    src = table[-1]
    assert [pair[0] for pair in decode.copy_pairs] == [src, src]  # the last writer keeps it
    assert all(c.block_table[0] == table[0] for c in decode.chunks)  # full prompt block shared
    assert len({c.block_table[-1] for c in decode.chunks}) == 3
    bm.check_integrity()


def test_a_one_token_final_chunk_inside_a_block_still_forks() -> None:
    """The last prompt token alone, mid-block, looks like a decode: it must fork all the same."""
    sched, _ = make_scheduler(num_blocks=32, max_num_batched_tokens=6)
    sched.add_request(request("r", 7, n=2, max_tokens=2))
    step(sched)  # six prompt tokens; the seventh is mid-block (block size 4)
    final = sched.schedule()
    assert list(final.sample_groups()) == [("r", "r#1")]
    assert final.num_decodes == 0


def test_n_children_finish_and_free_everything() -> None:
    sched, bm = make_scheduler(num_blocks=32)
    sched.add_request(request("r", 5, n=4, max_tokens=6))
    run_to_completion(sched)
    assert bm.num_free_blocks == 32 and sched.get_request("r") is None
    bm.check_integrity()


def test_static_batch_admits_nothing_until_its_longest_member_finishes() -> None:
    sched, _ = make_scheduler(max_num_batched_tokens=64, policy="static")
    sched.add_request(request("a", 4, max_tokens=2))
    sched.add_request(request("b", 4, max_tokens=6))
    assert sizes(step(sched)[0]) == {"a": 4, "b": 4}
    sched.add_request(request("c", 4, max_tokens=2))
    seen = []
    while sched.has_unfinished():
        seen.append(sizes(step(sched)[0]))
    assert seen[:5] == [{"a": 1, "b": 1}, {"b": 1}, {"b": 1}, {"b": 1}, {"b": 1}]
    assert seen[5:] == [{"c": 4}, {"c": 1}]


def test_static_batch_prefills_a_whole_batch_across_steps() -> None:
    sched, _ = make_scheduler(max_num_batched_tokens=8, max_num_seqs=3, policy="static")
    for name in ("a", "b", "c", "d"):
        sched.add_request(request(name, 6, max_tokens=4))
    assert sizes(step(sched)[0]) == {"a": 6, "b": 2}
    assert sizes(step(sched)[0]) == {"a": 1, "b": 4, "c": 3}
    assert sched.num_running == 3 and sched.num_waiting == 1


def test_contiguous_allocation_reserves_prompt_plus_max_tokens() -> None:
    """The reservation is every slot written: prompt + max_tokens less the last sampled token."""
    sched, bm = make_scheduler(num_blocks=16, allocation="contiguous")
    sched.add_request(request("a", 5, max_tokens=12))  # 16 slots = 4 blocks
    sched.add_request(request("b", 5, max_tokens=41))  # 45 slots = 12 blocks
    sched.add_request(request("c", 2, max_tokens=2))  # 1 block: no room left
    output, _ = step(sched)
    assert sizes(output) == {"a": 5, "b": 5}
    assert bm.num_tokens("a") == 16 and bm.num_tokens("b") == 45
    assert bm.num_free_blocks == 0
    assert sched.num_waiting == 1
    tables = {c.seq_id: c.block_table for c in output.chunks}
    for _ in range(5):
        output, _ = step(sched)
        assert {c.seq_id: c.block_table for c in output.chunks} == tables
    assert output.preempted_seq_ids == ()


def test_contiguous_rejects_parallel_sampling() -> None:
    sched, _ = make_scheduler(allocation="contiguous")
    with pytest.raises(InvalidParameterError) as info:
        sched.add_request(request("r", 4, n=2))
    assert info.value.field == "n"


def test_unknown_policy_is_a_typed_error() -> None:
    with pytest.raises(InvalidParameterError) as info:
        make_scheduler(policy="lottery")
    assert info.value.field == "policy"
