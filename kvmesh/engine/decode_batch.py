"""The runner's persistent decode batch: a decode step's host inputs built from the last one.

In steady decoding consecutive steps schedule the same sequences in the same order, and the
scheduler hands over the same block-table tuple object until a table changes (a sequence
crossed into a new block: about one sequence in `block_size` per step). So a decode step
(one token per chunk) costs the runner:

    same sequences as the last decode step   the rows of the tables that changed (identity
                                             test per sequence, C-level), written in place
    otherwise                                the persistent block table's gather (rows by
                                             sequence id, `block_table.py`), kept for next time

and its ids, positions and slots become one numpy array (no per-token Python), the sequence
lengths are positions + 1 and the query bounds a cached 0..B range.

    DecodeInputs   token_ids, positions, slots [B] int64, seq_lens [B] int32,
                   query_start_loc [B + 1] int32, block_tables [B, width] int32 (host)
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import chain, compress
from operator import attrgetter, itemgetter

import numpy as np
import torch

from kvmesh.engine.block_table import PersistentBlockTable

_SEQ_ID, _TOKEN_IDS, _START_POS = (
    attrgetter("seq_id"),
    attrgetter("token_ids"),
    attrgetter("start_pos"),
)
_BLOCK_TABLE, _SLOTS = attrgetter("block_table"), attrgetter("slot_mapping")
_FIRST = itemgetter(0)


@dataclass(frozen=True)
class DecodeInputs:
    """Host tensors of one decode step (see the module doc)."""

    token_ids: torch.Tensor
    positions: torch.Tensor
    slots: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    block_tables: torch.Tensor


class PersistentDecodeBatch:
    """Last decode step's sequence ids, tables and table rows over a PersistentBlockTable."""

    def __init__(self, block_tables: PersistentBlockTable):
        self.block_tables = block_tables
        self._ids: list[str] = []
        self._tables: list[tuple[int, ...]] = []
        self._rows = np.zeros((0, 0), dtype=np.int32)  # [B, width] of the last decode step
        self._range = torch.arange(1)  # 0..n, grown on demand
        self._starts = self._range.to(torch.int32)
        self.rows_reused = 0  # steps served by in-place row updates (tests and benchmarks)

    def inputs(self, chunks: Sequence[object]) -> DecodeInputs:
        """The host inputs of a step whose chunks all hold one token."""
        count = len(chunks)
        host = np.fromiter(
            chain(
                map(_FIRST, map(_TOKEN_IDS, chunks)),
                map(_START_POS, chunks),
                chain.from_iterable(map(_SLOTS, chunks)),
            ),
            dtype=np.int64,
        ).reshape(3, -1)  # [3, B]: ids, positions, slots
        assert host.shape == (3, count), "decode chunks carry one token and one slot each"
        self._grow(count + 1)
        return DecodeInputs(
            torch.from_numpy(host[0]),
            torch.from_numpy(host[1]),
            torch.from_numpy(host[2]),
            torch.from_numpy((host[1] + 1).astype(np.int32)),
            self._starts[: count + 1],
            self.tables(list(map(_SEQ_ID, chunks)), list(map(_BLOCK_TABLE, chunks))),
        )

    def sample_rows(self, count: int) -> torch.Tensor:
        """Rows 0..count-1 [count] int64: every decode chunk's logits row."""
        self._grow(count)
        return self._range[:count]

    def _grow(self, size: int) -> None:
        if self._range.shape[0] < size:
            self._range = torch.arange(2 * size)
            self._starts = self._range.to(torch.int32)

    def tables(self, seq_ids: list[str], tables: list[tuple[int, ...]]) -> torch.Tensor:
        """[B, width] int32 block tables, width = the longest table (entries past a table's
        length are zero or stale; never read)."""
        if seq_ids != self._ids:
            gathered = self.block_tables.gather(seq_ids, tables)  # a fresh copy
            self._ids, self._tables, self._rows = seq_ids, tables, gathered.numpy()
            return gathered
        width = max(map(len, tables), default=0)
        rows = self._rows
        if width > rows.shape[1]:
            rows = self._rows = np.pad(rows, ((0, 0), (0, width - rows.shape[1])))
        changed = compress(range(len(tables)), map(operator.is_not, tables, self._tables))
        for index in changed:
            table = tables[index]
            rows[index, : len(table)] = table
        self._tables = tables
        self.rows_reused += 1
        return torch.from_numpy(rows[:, :width] if width < rows.shape[1] else rows)
