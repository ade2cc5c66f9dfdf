"""PersistentBatch: rows kept from the plans' diffs alone give every step's inputs exactly as a
fresh flattening of the step's whole chunks would, over steps that add, grow, replace, drop
and reorder sequences and mix decodes with prefill chunks."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvmesh.engine.input_batch import PersistentBatch
from kvmesh.engine.scheduler.plan import NewSeq, ScheduledChunk, SchedulerOutput, plan_of_chunks

MAX_BLOCKS, BLOCK_SIZE = 12, 4
IDS = [f"s{i}" for i in range(8)]

step_strategy = st.tuples(
    st.lists(st.sampled_from(IDS), min_size=1, max_size=6, unique=True),  # scheduled
    st.lists(st.sampled_from(["same", "grow", "replace"]), min_size=6, max_size=6),
    st.lists(st.integers(1, 5), min_size=6, max_size=6),  # tokens of each chunk
    st.lists(st.sampled_from(IDS), max_size=3, unique=True),  # leaving after the step
)


class Driver:
    """Plays the scheduler: whole tables per sequence, and the diffs the runner needs."""

    def __init__(self) -> None:
        self.tables: dict[str, tuple[int, ...]] = {}
        self.sent: dict[str, tuple[int, ...]] = {}
        self.departed: list[str] = []
        self.next_block = iter(range(1, 10**6))

    def table(self, seq_id: str, action: str) -> tuple[int, ...]:
        old = self.tables.get(seq_id) or (next(self.next_block),)
        if action == "grow" and len(old) < MAX_BLOCKS:
            old = (*old, next(self.next_block))
        elif action == "replace":
            old = tuple(next(self.next_block) for _ in old)
        self.tables[seq_id] = old
        return old

    def plan(self, chunks: list[ScheduledChunk]) -> SchedulerOutput:
        new_seqs, grown = [], []
        for chunk in chunks:
            known = self.sent.get(chunk.seq_id)
            table = chunk.block_table
            if known is not None and table[: len(known)] == known:
                if len(table) > len(known):
                    grown.append((chunk.seq_id, table[len(known) :]))
            else:
                new_seqs.append(NewSeq(chunk.seq_id, table))
            self.sent[chunk.seq_id] = table
        plan = plan_of_chunks(
            chunks, block_size=BLOCK_SIZE, new_seqs=new_seqs, finished_seq_ids=self.departed
        )
        self.departed = []
        return _with_new_blocks(plan, tuple(grown))

    def leave(self, seq_id: str) -> None:
        if self.sent.pop(seq_id, None) is not None:
            self.departed.append(seq_id)
        self.tables.pop(seq_id, None)


def _with_new_blocks(plan: SchedulerOutput, grown: tuple) -> SchedulerOutput:
    fields = {name: getattr(plan, name) for name in SchedulerOutput.__slots__}
    return SchedulerOutput(**(fields | {"new_block_ids": grown}))


@settings(max_examples=150, deadline=None)
@given(st.lists(step_strategy, min_size=1, max_size=10))
def test_inputs_equal_a_fresh_flattening(steps: list) -> None:
    batch, driver = PersistentBatch(MAX_BLOCKS, initial_rows=2), Driver()
    for seq_ids, actions, sizes, leaving in steps:
        chunks = []
        for seq_id, action, size in zip(seq_ids, actions, sizes, strict=False):
            table = driver.table(seq_id, action)
            size = min(size, len(table) * BLOCK_SIZE)
            start = len(table) * BLOCK_SIZE - size  # the chunk ends in the table's last block
            tokens = tuple(range(start, start + size))
            sample = (seq_id,) if size == 1 or start % 2 else ()
            chunks.append(ScheduledChunk(seq_id, tokens, start, table, (), sample))
        plan = driver.plan(chunks)
        batch.apply(plan)
        check_inputs(batch, plan)
        for seq_id in leaving:
            driver.leave(seq_id)
    # rows are held exactly by the sequences still sent and those departed since the last plan
    assert set(batch.row_of) == set(driver.sent) | set(driver.departed)


def check_inputs(batch: PersistentBatch, plan: SchedulerOutput) -> None:
    got = batch.inputs(plan, BLOCK_SIZE)
    chunks = plan.chunks  # the whole chunks, slots from each whole table
    assert got.token_ids.tolist() == list(plan.token_ids)
    positions = [p for c in chunks for p in range(c.start_pos, c.start_pos + len(c.token_ids))]
    assert got.positions.tolist() == positions
    assert got.slots.tolist() == [slot for c in chunks for slot in c.slot_mapping]
    assert got.seq_lens.tolist() == [c.start_pos + len(c.token_ids) for c in chunks]
    bounds = [0]
    for chunk in chunks:
        bounds.append(bounds[-1] + len(chunk.token_ids))
    assert got.query_start_loc.tolist() == bounds
    sampled = [end - 1 for end, c in zip(bounds[1:], chunks, strict=True) if c.sample_seq_ids]
    assert got.sample_rows.tolist() == sampled
    width = max(len(c.block_table) for c in chunks)
    assert got.block_tables.shape == (len(chunks), width)
    assert got.block_tables.is_contiguous()  # kernels take the rows as they are
    for row, chunk in zip(got.block_tables.tolist(), chunks, strict=True):
        assert tuple(row[: len(chunk.block_table)]) == chunk.block_table


def test_rows_are_freed_only_when_a_sequence_leaves() -> None:
    batch = PersistentBatch(MAX_BLOCKS, initial_rows=2)
    a = ScheduledChunk("a", (5,), 6, (1, 2), (), ("a",))
    b = ScheduledChunk("b", (6,), 2, (3,), (), ("b",))
    new = (NewSeq("a", (1, 2)), NewSeq("b", (3,)))
    batch.apply(plan_of_chunks((a, b), block_size=BLOCK_SIZE, new_seqs=new))
    batch.apply(plan_of_chunks((a,), block_size=BLOCK_SIZE))  # b sits this step out
    assert len(batch) == 2
    batch.apply(plan_of_chunks((a,), block_size=BLOCK_SIZE, finished_seq_ids=("b",)))
    assert set(batch.row_of) == {"a"}


def test_a_table_longer_than_a_sequence_may_hold_is_refused() -> None:
    batch = PersistentBatch(2)
    chunk = ScheduledChunk("a", (5,), 0, (1, 2, 3), (), ("a",))
    plan = plan_of_chunks((chunk,), block_size=BLOCK_SIZE, new_seqs=(NewSeq("a", (1, 2, 3)),))
    with pytest.raises(ValueError, match="more than the 2"):
        batch.apply(plan)
