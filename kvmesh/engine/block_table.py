"""The runner's persistent block table: one row per scheduled sequence, updated by diffs.

A sequence's block table only grows, and the scheduler hands the runner the same tuple object
until it changes (`kvmesh.engine.scheduler.state.SchedulerState.make_chunk`). So per step the
runner writes nothing for a sequence whose tuple it has seen, only the new block ids when the
table grew, and the whole row when the table was replaced (copy-on-write, preemption); the
step's `[batch, width]` table is then one row gather. Rows of sequences absent from a step are
released (a sequence scheduled again later is written anew), so the table never holds more rows
than one step's batch plus the free list.

    rows  [capacity, max_blocks] int32   row r = the blocks of the sequence mapped to r;
                                         entries past its length are stale and never read
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


class PersistentBlockTable:
    """Rows of block ids keyed by sequence id; `gather(chunks)` -> [batch, width] int32."""

    def __init__(self, max_blocks_per_seq: int, initial_rows: int = 64):
        self.max_blocks = max_blocks_per_seq
        self._rows = np.zeros((initial_rows, max_blocks_per_seq), dtype=np.int32)
        self._row_of: dict[str, int] = {}
        self._known: dict[str, tuple[int, ...]] = {}  # the table each row holds
        self._free: list[int] = list(range(initial_rows - 1, -1, -1))
        self.rows_written = 0  # whole or partial row writes (for tests and benchmarks)

    def __len__(self) -> int:
        return len(self._row_of)

    def gather(self, seq_ids: Sequence[str], tables: Sequence[tuple[int, ...]]) -> torch.Tensor:
        """The step's block tables [len(seq_ids), width] int32 (width = longest table), with
        every row's first len(table) entries equal to its table. Sequences not in `seq_ids`
        lose their rows."""
        rows = [self._sync(seq_id, table) for seq_id, table in zip(seq_ids, tables, strict=True)]
        if len(self._row_of) > len(rows):
            self._release_absent(set(seq_ids))
        width = max((len(table) for table in tables), default=0)
        return torch.from_numpy(self._rows[rows, :width])  # [batch, width] (a copy)

    def _sync(self, seq_id: str, table: tuple[int, ...]) -> int:
        row = self._row_of.get(seq_id)
        if row is None:
            row = self._row_of[seq_id] = self._take_row()
            known: tuple[int, ...] = ()
        else:
            known = self._known[seq_id]
            if table is known:
                return row
        if len(table) > self.max_blocks:
            raise ValueError(
                f"block_table of {seq_id!r} has {len(table)} blocks, more than the "
                f"{self.max_blocks} a sequence of max_model_len can hold"
            )
        start = len(known) if table[: len(known)] == known else 0
        self._rows[row, start : len(table)] = table[start:]
        self._known[seq_id] = table
        self.rows_written += 1
        return row

    def _take_row(self) -> int:
        if not self._free:
            grown = len(self._rows)
            self._rows = np.concatenate([self._rows, np.zeros_like(self._rows)])
            self._free = list(range(2 * grown - 1, grown - 1, -1))
        return self._free.pop()

    def _release_absent(self, present: set[str]) -> None:
        for seq_id in [s for s in self._row_of if s not in present]:
            self._free.append(self._row_of.pop(seq_id))
            del self._known[seq_id]
