"""The decode fast path (no block manager call inside a block, cached block tables) checked
against the block manager and a shadow KV cache: every planned slot and table is exact,
copy-on-write copies happen before writes, and every context reads back its own tokens."""

from __future__ import annotations

import itertools
import random

import pytest

from kvmesh.engine.scheduler import Scheduler, SchedulerOutput
from kvmesh.engine.sequence import Sequence
from kvmesh.memory import BlockManager
from tests.engine.scheduler_harness import TableMirror, make_scheduler, request


class ShadowKV:
    """Slot -> (position, token): what a model would have written, copies included."""

    def __init__(self, block_size: int) -> None:
        self.bs = block_size
        self.slots: dict[int, tuple[int, int]] = {}

    def run(self, sched: Scheduler, output: SchedulerOutput) -> None:
        bs = self.bs
        for src, dst in output.copy_pairs:  # before the forward pass
            for offset in range(bs):
                value = self.slots.get(src * bs + offset)
                if value is not None:
                    self.slots[dst * bs + offset] = value
        for chunk in output.chunks:
            for index, (token, slot) in enumerate(
                zip(chunk.token_ids, chunk.slot_mapping, strict=True)
            ):
                self.slots[slot] = (chunk.start_pos + index, token)
        for chunk in output.chunks:  # attention reads the whole context through the table
            tokens = live_seq(sched, chunk.seq_id).all_token_ids
            table = chunk.block_table
            end = chunk.start_pos + len(chunk.token_ids)
            for pos in range(end):
                slot = table[pos // bs] * bs + pos % bs
                assert self.slots.get(slot) == (pos, tokens[pos]), (chunk.seq_id, pos)


def live_seq(sched: Scheduler, seq_id: str) -> Sequence:
    request_id = seq_id.split("#")[0]
    found = sched.get_request(request_id)
    assert found is not None, seq_id
    return next(seq for seq in found.seqs if seq.seq_id == seq_id)


def check_plan_against_manager(output: SchedulerOutput, bm: BlockManager) -> None:
    for chunk in output.chunks:
        assert chunk.block_table == tuple(bm.block_table(chunk.seq_id)), chunk.seq_id
        end = chunk.start_pos + len(chunk.token_ids)
        expected = tuple(bm.slot_mapping(chunk.seq_id, chunk.start_pos, end))
        assert chunk.slot_mapping == expected, chunk.seq_id
        if len(chunk.sample_seq_ids) <= 1:  # (a forking chunk writes what its children share)
            for pos in range(chunk.start_pos, end):  # written blocks are private
                assert bm.ref_count(chunk.block_table[pos // bm.block_size]) == 1, chunk.seq_id


def sampled_tokens(output: SchedulerOutput, rng: random.Random) -> dict[str, int]:
    return {sid: rng.randrange(100, 140) for c in output.chunks for sid in c.sample_seq_ids}


@pytest.mark.parametrize("seed", range(6))
def test_decode_path_matches_manager_and_shadow_kv(seed: int) -> None:
    rng = random.Random(seed)
    block_size = 4
    num_blocks = rng.choice((24, 40, 200))  # small pools force preemption
    sched, bm = make_scheduler(
        num_blocks=num_blocks, block_size=block_size, max_num_batched_tokens=rng.choice((8, 64))
    )
    shared = [rng.randrange(50, 60) for _ in range(9)]  # prefix-cache hits
    for index in range(10):
        prompt = shared[: rng.randint(1, 9)] + [
            rng.randrange(60, 90) for _ in range(rng.randint(0, 6))
        ]
        n = rng.choice((1, 1, 2, 3))
        sched.add_request(request(f"r{index}", prompt, max_tokens=rng.randint(1, 14), n=n))
    shadow, mirror = ShadowKV(block_size), TableMirror()
    for _ in range(500):
        if not sched.has_unfinished():
            break
        output = sched.schedule()
        check_plan_against_manager(output, bm)
        mirror.apply(output)  # the diffs alone rebuild every scheduled table
        shadow.run(sched, output)
        sched.update(output, sampled_tokens(output, rng))
        bm.check_integrity()
    assert not sched.has_unfinished()
    assert bm.metrics().in_use_blocks == 0
    assert set(mirror.tables) == set(sched.state.departed)  # the next plan frees the rest


def test_decode_crossing_block_boundaries_gets_exact_slots() -> None:
    sched, bm = make_scheduler(block_size=4)
    sched.add_request(request("a", 3, max_tokens=12))
    slots: list[int] = []
    tables: list[tuple[int, ...]] = []
    for _ in range(12):
        output = sched.schedule()
        (chunk,) = output.chunks
        slots.extend(chunk.slot_mapping)
        tables.append(chunk.block_table)
        sched.update(output, {"a": 7})
        bm.check_integrity()
    # positions 0..13 computed (the prompt, then one decode per step)
    table = tables[-1]
    assert slots == [table[pos // 4] * 4 + pos % 4 for pos in range(14)]
    assert [len(t) for t in tables] == [1, 1, 2, 2, 2, 2, 3, 3, 3, 3, 4, 4]
    assert all(t[: len(prev)] == prev for prev, t in itertools.pairwise(tables))  # only grows


def test_forked_children_copy_the_shared_partial_block_before_writing() -> None:
    sched, bm = make_scheduler(block_size=4)
    sched.add_request(request("a", 6, max_tokens=4, n=3))
    output = sched.schedule()
    shared_last = output.chunks[0].block_table[-1]
    sched.update(output, {"a": 7, "a#1": 8, "a#2": 9})
    output = sched.schedule()
    copies = dict(output.copy_pairs)
    assert len(output.copy_pairs) == 2 and set(copies) == {shared_last}
    owners = {chunk.seq_id: chunk.block_table[-1] for chunk in output.chunks}
    assert sorted(owners.values()).count(shared_last) == 1  # one child keeps the original
    check_plan_against_manager(output, bm)
    sched.update(output, {"a": 7, "a#1": 8, "a#2": 9})
    bm.check_integrity()
