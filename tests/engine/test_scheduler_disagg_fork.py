"""Parallel sampling (n > 1) across disaggregation: prefill-only children park, imports fork."""

from __future__ import annotations

import pytest
from scheduler_harness import EOS, make_scheduler, request, run_to_completion, step

from kvmesh.engine.errors import InvalidParameterError
from kvmesh.engine.sequence import SequenceStatus


def test_prefill_only_request_forks_and_parks_every_child_on_shared_blocks() -> None:
    sched, bm = make_scheduler(num_blocks=16, max_num_batched_tokens=4)
    sched.add_request(request("p", 6, n=3, prefill_only=True))
    step(sched)
    _, changed = step(sched, {"p": 40, "p#1": 41, "p#2": 42})
    assert [s.output_ids for s in changed] == [[40], [41], [42]]
    assert all(s.status is SequenceStatus.PREFILLED for s in changed)
    table = bm.block_table("p")
    assert [bm.block_table(s.seq_id) for s in changed] == [table] * 3
    assert all(bm.ref_count(block) == 3 for block in table)
    assert sched.num_prefilled == 3 and sched.schedule().is_empty
    bm.check_integrity()
    assert [s.seq_id for s in sched.release_prefilled("p")] == ["p", "p#1", "p#2"]
    assert bm.num_free_blocks == 16 and sched.get_request("p") is None


def test_prefill_only_child_ended_by_its_first_token_leaves_the_others_parked() -> None:
    sched, bm = make_scheduler(num_blocks=16)
    sched.add_request(request("p", 6, n=2, prefill_only=True, ignore_eos=False))
    _, (first, second) = step(sched, {"p": EOS, "p#1": 9})
    assert first.finish_reason == "stop" and second.status is SequenceStatus.PREFILLED
    assert bm.block_table("p#1") and not bm.has("p")
    assert [s.seq_id for s in sched.release_prefilled("p")] == ["p#1"]
    assert bm.num_free_blocks == 16


def test_import_forks_n_decodes_sharing_the_prompt_copy_on_write() -> None:
    sched, bm = make_scheduler(num_blocks=16)
    imported = request("remote", 6, n=3, max_tokens=4)
    assert bm.allocate("remote", 6) is not None  # the caller writes the prompt KV here
    table = bm.block_table("remote")
    assert sched.add_prefilled_request(imported, 6, first_tokens=[50, 51, 52]) == []
    assert [s.seq_id for s in imported.seqs] == ["remote", "remote#1", "remote#2"]
    assert all(bm.ref_count(block) == 3 for block in table)
    output, _ = step(sched, {"remote": 60, "remote#1": 61, "remote#2": 62})
    chunks = {c.seq_id: c for c in output.chunks}
    assert {s: c.token_ids for s, c in chunks.items()} == {
        "remote": (50,),
        "remote#1": (51,),
        "remote#2": (52,),
    }
    assert [pair[0] for pair in output.copy_pairs] == [table[-1]] * 2  # partial block copied
    assert len({c.block_table[-1] for c in chunks.values()}) == 3
    assert all(c.block_table[0] == table[0] for c in chunks.values())
    bm.check_integrity()
    run_to_completion(sched)
    assert [s.output_ids[:2] for s in imported.seqs] == [[50, 60], [51, 61], [52, 62]]
    assert all(s.finish_reason == "length" for s in imported.seqs)
    assert bm.num_free_blocks == 16
    bm.check_integrity()


def test_import_whose_first_tokens_end_some_completions_frees_only_their_share() -> None:
    sched, bm = make_scheduler(num_blocks=16)
    imported = request("remote", 8, n=3, max_tokens=3, ignore_eos=False)
    bm.allocate("remote", 8)
    ended = sched.add_prefilled_request(imported, 8, first_tokens=[EOS, 70, EOS])
    assert [s.seq_id for s in ended] == ["remote", "remote#2"]
    assert sched.num_running == 1 and bm.num_free_blocks == 16 - 2
    run_to_completion(sched)
    assert bm.num_free_blocks == 16 and sched.get_request("remote") is None
    bm.check_integrity()


def test_import_needs_one_first_token_per_completion() -> None:
    sched, bm = make_scheduler(num_blocks=16)
    bm.allocate("remote", 6)
    with pytest.raises(InvalidParameterError) as info:
        sched.add_prefilled_request(request("remote", 6, n=3), 6, first_tokens=[1, 2])
    assert info.value.field == "first_tokens"
    assert sched.num_running == 0 and sched.get_request("remote") is None


def test_request_waiting_for_remote_kv_holds_blocks_unscheduled_until_imported() -> None:
    """WAITING_FOR_REMOTE_KV: the prompt's blocks and the forks' spares are held, nothing is
    scheduled; the import joins it as n decodes (spares freed), an abort frees everything."""
    sched, bm = make_scheduler(num_blocks=16)
    waiting = request("remote", 6, n=3, max_tokens=4)
    table = sched.add_remote_request(waiting, spare_blocks=2)
    assert table == bm.block_table("remote") and len(table) == 2
    assert bm.num_free_blocks == 16 - 2 - 2
    assert waiting.seqs[0].status is SequenceStatus.WAITING_FOR_REMOTE_KV
    assert sched.schedule().is_empty and not sched.has_unfinished()
    with pytest.raises(InvalidParameterError, match="already exists"):
        sched.add_remote_request(request("remote", 6, n=3), spare_blocks=2)
    assert sched.add_prefilled_request(waiting, 6, first_tokens=[50, 51, 52]) == []
    assert bm.num_free_blocks == 16 - 2 and sched.num_running == 3
    sched.abort_request("remote")
    assert bm.num_free_blocks == 16

    assert bm.allocate("other", 14 * 4) is not None  # 2 blocks left
    assert sched.add_remote_request(request("short", 12)) is None and bm.num_free_blocks == 2
    bm.free("other")
    dropped = request("dropped", 6, n=2)
    assert sched.add_remote_request(dropped, spare_blocks=1) is not None
    assert [s.seq_id for s in sched.abort_request("dropped")] == ["dropped"]
    assert bm.num_free_blocks == 16 and sched.get_request("dropped") is None
    bm.check_integrity()


def test_spare_blocks_that_are_not_a_count_are_refused_holding_nothing() -> None:
    """add_remote_request checks spare_blocks before it allocates: a negative or fractional
    count is refused naming it, with no prompt block held."""
    sched, bm = make_scheduler(num_blocks=16)
    for spares in (-1, 1.5):
        with pytest.raises(InvalidParameterError) as refused:
            sched.add_remote_request(request("r", 6, n=2), spare_blocks=spares)  # type: ignore[arg-type]
        assert refused.value.field == "spare_blocks"
        assert not bm.has("r") and sched.get_request("r") is None
        assert bm.num_free_blocks == 16
    bm.check_integrity()


def test_every_entry_refuses_a_request_id_naming_a_child() -> None:
    """A request id holding "#" could equal a child's sequence id ("r#1" of "r", n = 2):
    add_request, add_remote_request and add_prefilled_request refuse it, naming request_id,
    and change nothing; "r" then runs both its samples to the end."""
    sched, bm = make_scheduler(num_blocks=16)
    pair = request("r", 6, n=2, max_tokens=4)
    sched.add_request(pair)
    step(sched)  # the whole prompt: forked into "r" and "r#1"
    before = (sched.num_running, sched.num_waiting, bm.metrics())
    for add in (
        lambda: sched.add_request(request("r#1", 6)),
        lambda: sched.add_remote_request(request("r#1", 6), spare_blocks=1),
        lambda: sched.add_prefilled_request(request("r#1", 6), 6, first_tokens=[50]),
    ):
        with pytest.raises(InvalidParameterError) as refused:
            add()
        assert refused.value.field == "request_id"
        assert sched.get_request("r#1") is None
        assert (sched.num_running, sched.num_waiting, bm.metrics()) == before
    run_to_completion(sched)
    assert [(s.seq_id, len(s.output_ids)) for s in pair.seqs] == [("r", 4), ("r#1", 4)]
    assert bm.num_free_blocks == 16
    bm.check_integrity()
