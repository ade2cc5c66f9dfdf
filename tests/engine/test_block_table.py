"""PersistentBlockTable against a freshly padded table, over random growth, replacement,
absence and reuse of sequence ids."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvmesh.engine.block_table import PersistentBlockTable

MAX_BLOCKS = 12

step_actions = st.lists(
    st.tuples(
        st.sampled_from([f"s{i}" for i in range(10)]),
        st.sampled_from(["same", "grow", "replace"]),
        st.integers(0, 3),
    ),
    min_size=1,
    max_size=8,
    unique_by=lambda action: action[0],
)


@settings(max_examples=150, deadline=None)
@given(st.lists(step_actions, min_size=1, max_size=12))
def test_rows_equal_the_step_tables(steps: list[list[tuple[str, str, int]]]) -> None:
    table = PersistentBlockTable(MAX_BLOCKS, initial_rows=2)
    current: dict[str, tuple[int, ...]] = {}
    next_block = iter(range(10**6))
    for actions in steps:
        ids, tables = [], []
        for seq_id, action, count in actions:
            old = current.get(seq_id, ())
            if action == "grow" or seq_id not in current:
                new = old + tuple(next(next_block) for _ in range(count))
            elif action == "replace":
                new = tuple(next(next_block) for _ in range(len(old)))
            else:
                new = old
            current[seq_id] = new[:MAX_BLOCKS]
            ids.append(seq_id)
            tables.append(current[seq_id])
        got = table.gather(ids, tables)
        width = max(len(t) for t in tables)
        assert got.shape == (len(ids), width) and got.dtype == torch.int32
        for row, expected in zip(got.tolist(), tables, strict=True):
            assert tuple(row[: len(expected)]) == expected
        assert len(table) == len(ids)  # absent sequences released their rows


def test_unchanged_tuple_writes_nothing_and_growth_writes_once() -> None:
    table = PersistentBlockTable(MAX_BLOCKS)
    first = (3, 4)
    table.gather(["a"], [first])
    table.gather(["a"], [first])
    assert table.rows_written == 1
    table.gather(["a"], [(*first, 9)])
    assert table.rows_written == 2
    assert table.gather(["a"], [(3, 4, 9)]).tolist() == [[3, 4, 9]]


def test_table_longer_than_a_sequence_can_hold_is_refused() -> None:
    with pytest.raises(ValueError, match="more than the 12"):
        PersistentBlockTable(MAX_BLOCKS).gather(["a"], [tuple(range(13))])
