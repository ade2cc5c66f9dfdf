"""`StepBuilder`: the columns of the step being planned, turned into one `SchedulerOutput`.

Two sections, as the plan orders them: decodes (one token each, sampled for the sequence
itself) and prefill chunks (any other chunk). The scheduler's decode hot path appends to the
decode columns directly (bound `list.append`s, no object per sequence); every other chunk goes
through `add`.
"""

from __future__ import annotations

from kvmesh.engine.scheduler.plan import NewSeq, SchedulerOutput


class StepBuilder:
    """Column lists of one step; `build` freezes them into the plan."""

    __slots__ = (
        "decode_ids",
        "decode_starts",
        "decode_tables",
        "decode_tokens",
        "new_block_ids",
        "new_seqs",
        "prefill_ids",
        "prefill_lens",
        "prefill_samples",
        "prefill_starts",
        "prefill_tables",
        "prefill_tokens",
    )

    def __init__(self) -> None:
        self.decode_ids: list[str] = []
        self.decode_starts: list[int] = []
        self.decode_tokens: list[int] = []
        self.decode_tables: list[tuple[int, ...]] = []
        self.prefill_ids: list[str] = []
        self.prefill_starts: list[int] = []
        self.prefill_lens: list[int] = []
        self.prefill_tokens: list[int] = []
        self.prefill_tables: list[tuple[int, ...]] = []
        self.prefill_samples: list[tuple[str, ...]] = []
        self.new_seqs: list[NewSeq] = []
        self.new_block_ids: list[tuple[str, tuple[int, ...]]] = []

    @property
    def num_chunks(self) -> int:
        return len(self.decode_ids) + len(self.prefill_ids)

    def add(
        self,
        seq_id: str,
        start: int,
        token_ids: list[int],
        table: tuple[int, ...],
        samples: tuple[str, ...],
    ) -> None:
        """A chunk computing `token_ids` from position `start`; `samples` sample its last row."""
        if len(token_ids) == 1 and samples == (seq_id,):
            self.decode_ids.append(seq_id)
            self.decode_starts.append(start)
            self.decode_tokens.append(token_ids[0])
            self.decode_tables.append(table)
            return
        self.prefill_ids.append(seq_id)
        self.prefill_starts.append(start)
        self.prefill_lens.append(len(token_ids))
        self.prefill_tokens.extend(token_ids)
        self.prefill_tables.append(table)
        self.prefill_samples.append(samples)

    def build(
        self,
        finished: tuple[str, ...],
        copy_pairs: tuple[tuple[int, int], ...],
        num_batched_tokens: int,
        preempted: tuple[str, ...],
        block_size: int,
    ) -> SchedulerOutput:
        return SchedulerOutput(
            seq_ids=(*self.decode_ids, *self.prefill_ids),
            start_positions=(*self.decode_starts, *self.prefill_starts),
            token_ids=(*self.decode_tokens, *self.prefill_tokens),
            num_decodes=len(self.decode_ids),
            prefill_lens=tuple(self.prefill_lens),
            prefill_samples=tuple(self.prefill_samples),
            block_tables=(*self.decode_tables, *self.prefill_tables),
            new_seqs=tuple(self.new_seqs),
            new_block_ids=tuple(self.new_block_ids),
            finished_seq_ids=finished,
            copy_pairs=copy_pairs,
            num_batched_tokens=num_batched_tokens,
            preempted_seq_ids=preempted,
            block_size=block_size,
        )
