"""Stop rules and finish reasons; prefill-only mode and the decode import path."""

from __future__ import annotations

import pytest
from scheduler_harness import EOS, make_scheduler, request, step

from kvmesh.engine.errors import InvalidParameterError
from kvmesh.engine.scheduler import Scheduler
from kvmesh.engine.sequence import Sequence, SequenceStatus


def generate(sched: Scheduler, tokens: list[int]) -> Sequence:
    """Feed `tokens` one per step to the single request "r" until it finishes."""
    for token in tokens:
        _, changed = step(sched, token)
        if changed and changed[0].status.is_finished:
            return changed[0]
    raise AssertionError("request did not finish")


def test_eos_stops_unless_ignored() -> None:
    sched, bm = make_scheduler(num_blocks=16)
    sched.add_request(request("r", 4, ignore_eos=False))
    seq = generate(sched, [5, EOS])
    assert seq.status is SequenceStatus.FINISHED_STOPPED and seq.finish_reason == "stop"
    assert seq.stop_reason is None and seq.output_ids == [5, EOS]
    assert bm.num_free_blocks == 16
    sched.add_request(request("r", 4, ignore_eos=True, max_tokens=3))
    seq = generate(sched, [EOS, EOS, EOS])
    assert seq.finish_reason == "length" and seq.output_ids == [EOS] * 3


def test_stop_token_ids_report_the_token() -> None:
    sched, _ = make_scheduler()
    sched.add_request(request("r", 4, stop_token_ids=[9, 11]))
    seq = generate(sched, [5, 11])
    assert seq.status is SequenceStatus.FINISHED_STOPPED and seq.stop_reason == 11


def test_min_tokens_suppresses_eos_and_stop_ids() -> None:
    sched, _ = make_scheduler()
    sched.add_request(request("r", 4, ignore_eos=False, min_tokens=3, stop_token_ids=[9]))
    seq = generate(sched, [EOS, 9, EOS, EOS])
    assert seq.output_ids == [EOS, 9, EOS] and seq.finish_reason == "stop"


def test_max_model_len_ends_with_length() -> None:
    sched, _ = make_scheduler(max_model_len=8)
    sched.add_request(request("r", 5, max_tokens=None))
    seq = generate(sched, [5] * 10)
    assert seq.finish_reason == "length" and seq.num_tokens == 8


def test_finish_sequence_for_stop_strings() -> None:
    sched, bm = make_scheduler(num_blocks=16)
    sched.add_request(request("r", 4))
    step(sched)
    seq = sched.finish_sequence("r", "stop", "END")
    assert seq.status is SequenceStatus.FINISHED_STOPPED and seq.stop_reason == "END"
    assert not sched.has_unfinished() and bm.num_free_blocks == 16
    with pytest.raises(InvalidParameterError):
        sched.finish_sequence("r")


def test_prefill_only_request_parks_holding_its_blocks() -> None:
    sched, bm = make_scheduler(num_blocks=16, max_num_batched_tokens=4)
    sched.add_request(request("p", 6, prefill_only=True))
    step(sched)
    _, changed = step(sched, 42)
    (seq,) = changed
    assert seq.status is SequenceStatus.PREFILLED and seq.output_ids == [42]
    assert seq.num_computed_tokens == 6 and bm.num_tokens("p") == 6
    assert not sched.has_unfinished() and sched.num_prefilled == 1
    assert sched.schedule().is_empty
    sched.release_prefilled("p")
    assert bm.num_free_blocks == 16 and sched.get_request("p") is None
    with pytest.raises(InvalidParameterError):
        sched.release_prefilled("p")


def test_prefilled_request_can_be_aborted() -> None:
    sched, bm = make_scheduler(num_blocks=16)
    sched.add_request(request("p", 6, prefill_only=True))
    step(sched)
    (seq,) = sched.abort_request("p")
    assert seq.finish_reason == "abort" and bm.num_free_blocks == 16


def test_imported_request_joins_as_a_decode() -> None:
    sched, bm = make_scheduler(num_blocks=16)
    sched.add_request(request("local", 4, max_tokens=8))
    step(sched)
    imported = request("remote", 6, max_tokens=3)
    assert bm.allocate("remote", 6) is not None  # the caller writes the prompt KV here
    assert sched.add_prefilled_request(imported, 6, first_tokens=[55]) == []
    output, _ = step(sched, 56)
    chunk = next(c for c in output.chunks if c.seq_id == "remote")
    assert chunk.start_pos == 6 and chunk.token_ids == (55,) and chunk.sample_seq_ids == ("remote",)
    assert [c.seq_id for c in output.chunks] == ["local", "remote"]
    _, changed = step(sched, 57)
    remote = next(s for s in changed if s.seq_id == "remote")
    assert remote.output_ids == [55, 56, 57] and remote.finish_reason == "length"
    bm.check_integrity()


def test_import_that_stops_at_once_frees_its_blocks() -> None:
    sched, bm = make_scheduler(num_blocks=16)
    imported = request("remote", 6, max_tokens=1)
    bm.allocate("remote", 6)
    (seq,) = sched.add_prefilled_request(imported, 6, first_tokens=[1])
    assert seq.finish_reason == "length" and bm.num_free_blocks == 16
    assert not sched.has_unfinished()


def test_import_checks_its_arguments() -> None:
    sched, bm = make_scheduler(num_blocks=16)
    bm.allocate("remote", 4)
    with pytest.raises(InvalidParameterError) as info:
        sched.add_prefilled_request(request("remote", 6), 6, first_tokens=[1])
    assert info.value.field == "num_computed_tokens"
    with pytest.raises(InvalidParameterError):
        sched.add_prefilled_request(request("remote", 6), 5, first_tokens=[1])
    assert sched.num_running == 0
