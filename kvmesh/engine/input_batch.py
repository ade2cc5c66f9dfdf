"""The runner's persistent batch: block-table rows kept from step to step, updated by the
plan's diffs, and the step's host inputs built from them column-wise.

Per step (`SchedulerOutput`, `kvmesh.engine.scheduler.plan`) the runner frees the rows of
`finished_seq_ids`, writes `new_seqs` whole and appends `new_block_ids`: in steady decoding
that is about one sequence in `block_size` per step, and nothing per sequence otherwise. The
step's inputs are then numpy expressions over the plan's columns, with no Python loop over
sequences or tokens:

    rows             [B]         each scheduled sequence's row (reused while the ids repeat)
    positions        [T]         start_positions expanded over each chunk's tokens
    slots            [T]         table[pos // block_size] * block_size + pos % block_size
    block_tables     [B, width]  the rows gathered, width = the longest table of the step;
                                 entries past a table's length are stale and never read
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import torch

from kvmesh.engine.scheduler.plan import SchedulerOutput


@dataclass(frozen=True)
class HostInputs:
    """Host tensors of one step (B sequences, T tokens, S sampled rows)."""

    token_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    slots: torch.Tensor  # [T] int64
    seq_lens: torch.Tensor  # [B] int32, context including this step's tokens
    query_start_loc: torch.Tensor  # [B + 1] int32
    block_tables: torch.Tensor  # [B, width] int32
    sample_rows: torch.Tensor  # [S] int64, the last row of each chunk that samples
    starts: np.ndarray  # [B] int64 start positions (host copy, for the attention context)


class PersistentBatch:
    """Rows of block ids keyed by sequence id, kept until the scheduler says it left."""

    def __init__(self, max_blocks_per_seq: int, initial_rows: int = 64):
        self.max_blocks = max_blocks_per_seq
        self.table_rows = np.zeros((initial_rows, max_blocks_per_seq), dtype=np.int32)
        self.lens = np.zeros(initial_rows, dtype=np.int64)  # [rows] table length per row
        self.row_of: dict[str, int] = {}
        self._free: list[int] = list(range(initial_rows - 1, -1, -1))
        self._last_ids: tuple[str, ...] = ()
        self._last_rows = np.zeros(0, dtype=np.intp)
        self._range = torch.arange(1)  # 0..n, grown on demand
        self._starts32 = self._range.to(torch.int32)

    def __len__(self) -> int:
        return len(self.row_of)

    # -- diffs ---------------------------------------------------------------------------------
    def apply(self, plan: SchedulerOutput) -> None:
        """Free, write and extend rows as the plan's diffs say (in that order)."""
        if plan.finished_seq_ids:
            self.remove(plan.finished_seq_ids)
        for seq_id, table in plan.new_seqs:
            row = self.row_of.get(seq_id)
            if row is None:
                row = self.row_of[seq_id] = self._take_row()
            self._write(seq_id, row, 0, table)
        for seq_id, added in plan.new_block_ids:
            row = self.row_of[seq_id]
            self._write(seq_id, row, int(self.lens[row]), added)

    def remove(self, seq_ids: Iterable[str]) -> None:
        """Free the rows of sequences that left (unknown ids are ignored)."""
        for seq_id in seq_ids:
            row = self.row_of.pop(seq_id, None)
            if row is not None:
                self._free.append(row)
        self._last_ids = ()

    def _write(self, seq_id: str, row: int, start: int, block_ids: tuple[int, ...]) -> None:
        end = start + len(block_ids)
        if end > self.max_blocks:
            raise ValueError(
                f"block_table of {seq_id!r} has {end} blocks, more than the "
                f"{self.max_blocks} a sequence of max_model_len can hold"
            )
        self.table_rows[row, start:end] = block_ids
        self.lens[row] = end

    def _take_row(self) -> int:
        if not self._free:
            grown = len(self.lens)
            self.table_rows = np.concatenate([self.table_rows, np.zeros_like(self.table_rows)])
            self.lens = np.concatenate([self.lens, np.zeros_like(self.lens)])
            self._free = list(range(2 * grown - 1, grown - 1, -1))
        return self._free.pop()

    # -- the step's inputs ---------------------------------------------------------------------
    def rows(self, seq_ids: tuple[str, ...]) -> np.ndarray:
        """[B] row of each sequence (the last step's array when the ids repeat)."""
        if seq_ids != self._last_ids:
            rows = np.fromiter(map(self.row_of.__getitem__, seq_ids), np.intp, len(seq_ids))
            self._last_ids, self._last_rows = seq_ids, rows
        return self._last_rows

    def inputs(self, plan: SchedulerOutput, block_size: int) -> HostInputs:
        """The step's host tensors (see the module doc)."""
        count, num_decodes = len(plan.seq_ids), plan.num_decodes
        rows = self.rows(plan.seq_ids)
        starts = np.fromiter(plan.start_positions, np.int64, count)  # [B]
        token_ids = np.fromiter(plan.token_ids, np.int64, len(plan.token_ids))  # [T]
        self._grow(count + 1)
        if num_decodes == count:  # one token each
            positions, token_rows, seq_lens = starts, rows, starts + 1
            query_start_loc = self._starts32[: count + 1]
            sample_rows = self._range[:count]
        else:
            lens = np.ones(count, dtype=np.int64)
            lens[num_decodes:] = plan.prefill_lens
            ends = np.cumsum(lens)  # [B]
            positions = np.repeat(starts - ends + lens, lens) + np.arange(ends[-1])  # [T]
            token_rows, seq_lens = np.repeat(rows, lens), starts + lens
            query_start_loc = torch.from_numpy(np.array([0, *ends.tolist()], dtype=np.int32))
            samples = np.ones(count, dtype=bool)
            samples[num_decodes:] = list(map(bool, plan.prefill_samples))
            sample_rows = torch.from_numpy(ends[samples] - 1)
        table_rows = self.table_rows
        blocks = table_rows[token_rows, positions // block_size].astype(np.int64)  # [T]
        width = int(self.lens[rows].max()) if count else 0
        return HostInputs(
            torch.from_numpy(token_ids),
            torch.from_numpy(positions),
            torch.from_numpy(blocks * block_size + positions % block_size),
            torch.from_numpy(seq_lens.astype(np.int32)),
            query_start_loc,
            torch.from_numpy(table_rows[rows, :width]),  # [B, width] (a contiguous copy)
            sample_rows,
            starts,
        )

    def _grow(self, size: int) -> None:
        if self._range.shape[0] < size:
            self._range = torch.arange(2 * size)
            self._starts32 = self._range.to(torch.int32)
