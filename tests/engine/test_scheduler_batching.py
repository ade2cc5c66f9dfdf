"""Continuous batching: decode-first order, token budget, chunked prefill, FCFS, seat limit."""

from __future__ import annotations

import pytest
from scheduler_harness import BLOCK_SIZE, make_scheduler, request, run_to_completion, sizes, step

from kvmesh.engine.errors import InvalidParameterError, PromptTooLongError
from kvmesh.engine.sequence import SequenceStatus


def test_decodes_come_first_then_prefill_chunks() -> None:
    sched, _ = make_scheduler(max_num_batched_tokens=64)
    sched.add_request(request("a", 8))
    step(sched)
    sched.add_request(request("b", 20))
    output, _ = step(sched)
    assert [c.seq_id for c in output.chunks] == ["a", "b"]
    decode, prefill = output.chunks
    assert decode.token_ids == (7,) and decode.start_pos == 8 and decode.sample_seq_ids == ("a",)
    assert prefill.start_pos == 0 and len(prefill.token_ids) == 20
    assert output.num_batched_tokens == 21


def test_long_prompt_split_into_exact_chunks() -> None:
    sched, _ = make_scheduler(max_num_batched_tokens=8)
    prompt = list(range(100, 120))
    sched.add_request(request("a", prompt))
    starts, chunks, samples = [], [], []
    for _ in range(3):
        output, _ = step(sched)
        (chunk,) = output.chunks
        starts.append(chunk.start_pos)
        chunks.append(chunk.token_ids)
        samples.append(chunk.sample_seq_ids)
    assert starts == [0, 8, 16]
    assert chunks == [tuple(prompt[0:8]), tuple(prompt[8:16]), tuple(prompt[16:20])]
    assert samples == [(), (), ("a",)]
    assert sched.get_request("a").seqs[0].output_ids == [7]  # type: ignore[union-attr]


def test_long_prompt_interleaves_with_running_decodes() -> None:
    sched, _ = make_scheduler(max_num_batched_tokens=8)
    sched.add_request(request("a", 4, max_tokens=20))
    step(sched)
    sched.add_request(request("b", 20))
    seen = [sizes(step(sched)[0]) for _ in range(3)]
    assert seen == [{"a": 1, "b": 7}, {"a": 1, "b": 7}, {"a": 1, "b": 6}]
    assert sizes(step(sched)[0]) == {"a": 1, "b": 1}


def test_slot_mapping_follows_block_table() -> None:
    sched, _ = make_scheduler(max_num_batched_tokens=6)
    sched.add_request(request("a", 10))
    for _ in range(4):
        output, _ = step(sched)
        for chunk in output.chunks:
            expected = [
                chunk.block_table[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE
                for pos in range(chunk.start_pos, chunk.start_pos + len(chunk.token_ids))
            ]
            assert list(chunk.slot_mapping) == expected


def test_token_budget_caps_every_step() -> None:
    sched, _ = make_scheduler(num_blocks=256, max_num_batched_tokens=16)
    for index in range(6):
        sched.add_request(request(f"r{index}", 7 + index, max_tokens=4))
    while sched.has_unfinished():
        output, _ = step(sched)
        assert 0 < output.num_batched_tokens <= 16
        assert output.num_batched_tokens == sum(len(c.token_ids) for c in output.chunks)


def test_fcfs_admission_and_max_num_seqs() -> None:
    sched, _ = make_scheduler(max_num_seqs=2, max_num_batched_tokens=64)
    sched.add_request(request("a", 4, max_tokens=2))
    sched.add_request(request("b", 4, max_tokens=5))
    sched.add_request(request("c", 4, max_tokens=2))
    assert set(sizes(step(sched)[0])) == {"a", "b"}
    assert sched.num_running == 2 and sched.num_waiting == 1
    _, changed = step(sched)  # a generates its 2nd token and leaves
    assert [s.seq_id for s in changed if s.status.is_finished] == ["a"]
    assert sizes(step(sched)[0]) == {"b": 1, "c": 4}


def test_fcfs_head_blocks_later_requests_without_chunking() -> None:
    sched, _ = make_scheduler(
        max_num_batched_tokens=32, max_model_len=32, enable_chunked_prefill=False
    )
    sched.add_request(request("a", 20, max_tokens=4))
    sched.add_request(request("b", 20, max_tokens=4))
    sched.add_request(request("c", 2, max_tokens=4))
    assert sizes(step(sched)[0]) == {"a": 20}  # b does not fit the rest; c may not pass it
    assert sizes(step(sched)[0]) == {"a": 1, "b": 20, "c": 2}


def test_long_prefill_token_threshold_caps_chunks() -> None:
    sched, _ = make_scheduler(max_num_batched_tokens=64, long_prefill_token_threshold=6)
    sched.add_request(request("a", 14))
    sched.add_request(request("b", 3))
    assert sizes(step(sched)[0]) == {"a": 6, "b": 3}
    assert sizes(step(sched)[0]) == {"b": 1, "a": 6}


def test_requests_that_never_fit_are_rejected_naming_the_field() -> None:
    sched, bm = make_scheduler(num_blocks=8, max_model_len=64)
    with pytest.raises(PromptTooLongError) as info:
        sched.add_request(request("a", 65))
    assert info.value.field == "prompt"
    with pytest.raises(PromptTooLongError) as info:
        sched.add_request(request("a", 4, max_tokens=65))  # more than the whole context
    assert info.value.field == "max_tokens"
    with pytest.raises(InvalidParameterError) as pool_info:
        sched.add_request(request("a", 30, max_tokens=4))  # 33 slots > 8 blocks of 4
    assert pool_info.value.field == "max_tokens"
    with pytest.raises(InvalidParameterError) as empty_info:
        sched.add_request(request("a", []))
    assert empty_info.value.field == "prompt"
    sched.add_request(request("a", 4))
    with pytest.raises(InvalidParameterError) as dup_info:
        sched.add_request(request("a", 4))
    assert dup_info.value.field == "request_id"
    assert sched.num_waiting == 1 and bm.num_free_blocks == 8


def test_finished_sequences_free_blocks_and_leave() -> None:
    sched, bm = make_scheduler(num_blocks=32)
    sched.add_request(request("a", 5, max_tokens=3))
    outputs = []
    while sched.has_unfinished():
        outputs.append(step(sched))
    seq = outputs[-1][1][0]
    assert seq.status is SequenceStatus.FINISHED_LENGTH and seq.finish_reason == "length"
    assert seq.output_ids == [7, 7, 7] and len(outputs) == 3
    assert bm.num_free_blocks == 32 and sched.get_request("a") is None
    bm.check_integrity()
    assert sched.schedule().is_empty


def test_a_request_filling_the_pool_exactly_is_accepted_and_runs() -> None:
    """The last sampled token ends a sequence before its KV is written: prompt + max_tokens
    - 1 slots must fit the pool. 12 + 5 tokens write 16 slots, the 4 blocks of 4; one token
    more is refused. The same holds at max_model_len (max_tokens None)."""
    sched, bm = make_scheduler(num_blocks=4)
    fits = request("r", 12, max_tokens=5)
    sched.add_request(fits)
    with pytest.raises(InvalidParameterError) as refused:
        sched.add_request(request("s", 12, max_tokens=6))
    assert refused.value.field == "max_tokens"
    run_to_completion(sched)
    assert len(fits.seqs[0].output_ids) == 5 and sched.num_preemptions == 0
    sched, bm = make_scheduler(num_blocks=4, max_model_len=17)
    whole = request("t", 12, max_tokens=None)
    sched.add_request(whole)
    run_to_completion(sched)
    assert whole.seqs[0].num_tokens == 17 and whole.seqs[0].finish_reason == "length"
    assert sched.num_preemptions == 0 and bm.num_free_blocks == 4
    bm.check_integrity()
