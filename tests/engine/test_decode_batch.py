"""PersistentDecodeBatch: decode-step inputs equal a fresh flattening, over steps that keep,
grow, replace or change the batch's sequences."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvmesh.engine.block_table import PersistentBlockTable
from kvmesh.engine.decode_batch import PersistentDecodeBatch
from kvmesh.engine.warmup import WarmupChunk

MAX_BLOCKS, BLOCK_SIZE = 12, 4

steps_strategy = st.lists(
    st.tuples(
        st.booleans(),  # keep the previous step's sequences (the in-place path)
        st.lists(st.sampled_from(["same", "grow", "replace"]), min_size=6, max_size=6),
        st.lists(st.sampled_from([f"s{i}" for i in range(6)]), min_size=1, max_size=6, unique=True),
    ),
    min_size=1,
    max_size=12,
)


@settings(max_examples=120, deadline=None)
@given(steps_strategy)
def test_inputs_equal_the_step(steps: list[tuple[bool, list[str], list[str]]]) -> None:
    batch = PersistentDecodeBatch(PersistentBlockTable(MAX_BLOCKS, initial_rows=2))
    current: dict[str, tuple[int, ...]] = {}
    next_block = iter(range(1, 10**6))
    ids: list[str] = []
    for keep, actions, fresh_ids in steps:
        ids = ids if keep and ids else fresh_ids
        chunks = []
        for seq_id, action in zip(ids, actions, strict=False):
            old = current.get(seq_id, (next(next_block),))
            if action == "grow":
                new = (*old, next(next_block))
            elif action == "replace":
                new = tuple(next(next_block) for _ in old)
            else:
                new = old
            table = current[seq_id] = new[:MAX_BLOCKS]
            position = len(table) * BLOCK_SIZE - 1  # the last slot of its last block
            slot = table[-1] * BLOCK_SIZE + BLOCK_SIZE - 1
            chunks.append(WarmupChunk(seq_id, (len(table),), position, table, (slot,)))
        got = batch.inputs(chunks)
        assert got.token_ids.tolist() == [len(c.block_table) for c in chunks]
        assert got.positions.tolist() == [c.start_pos for c in chunks]
        assert got.seq_lens.tolist() == [c.start_pos + 1 for c in chunks]
        assert got.slots.tolist() == [c.slot_mapping[0] for c in chunks]
        assert got.query_start_loc.tolist() == list(range(len(chunks) + 1))
        width = max(len(c.block_table) for c in chunks)
        assert got.block_tables.shape == (len(chunks), width)
        for row, chunk in zip(got.block_tables.tolist(), chunks, strict=True):
            assert tuple(row[: len(chunk.block_table)]) == chunk.block_table


def test_same_sequences_update_rows_in_place() -> None:
    batch = PersistentDecodeBatch(PersistentBlockTable(MAX_BLOCKS))
    a, b = (1, 2), (3,)
    first = [WarmupChunk("a", (5,), 7, a, (11,)), WarmupChunk("b", (6,), 2, b, (14,))]
    batch.inputs(first)
    grown = [first[0], WarmupChunk("b", (6,), 4, (*b, 9), (36,))]
    assert batch.inputs(grown).block_tables.tolist() == [[1, 2], [3, 9]]
    assert batch.rows_reused == 1
    assert batch.inputs(grown[:1]).block_tables.tolist() == [[1, 2]]  # other ids: gathered
    assert batch.rows_reused == 1
