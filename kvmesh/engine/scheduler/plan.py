"""The scheduler's per-step plan for the runner: the step's work plus diffs of the block tables.

The runner keeps a persistent batch: one block-table row per sequence it was told about. A
`SchedulerOutput` says what changed since the last plan (vLLM v1's split between new and
cached requests), applied in this order:

    finished_seq_ids   sequences that left since the last plan (finished, aborted, preempted,
                       released): their rows are freed
    new_seqs           (seq_id, whole block table): a sequence scheduled for the first time, or
                       one whose table was replaced (copy on write after a fork, readmission)
    new_block_ids      (seq_id, block ids appended to the table the runner holds)

and the step's work column-wise, with no object per sequence:

    seq_ids          [B]      scheduled sequences: decodes first, then prefill chunks
    start_positions  [B]      num_computed_tokens of each before the step
    token_ids        [T]      the tokens computed this step, flat, in sequence order
    num_decodes      D        the first D sequences compute one token each and sample it for
                              themselves (the decode section)
    prefill_lens     [B - D]  tokens of each later chunk
    prefill_samples  [B - D]  the sequences sampling from each later chunk's last logits row:
                              () mid-prompt, (seq_id,) normally, all n children when the final
                              prompt chunk of an n > 1 request forks them

Slots are the runner's to derive: `table[pos // block_size] * block_size + pos % block_size`.
`block_tables` [B] references each sequence's whole table (the scheduler's immutable tuples,
shared, never copied) for `chunks`, the per-sequence view that tests and tools read; the runner
reads the diffs only.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from itertools import chain, islice
from typing import NamedTuple


class ScheduledChunk(NamedTuple):
    """One sequence's tokens in one step, as `SchedulerOutput.chunks` shows them.

    `start_pos` is the position of `token_ids[0]` (== num_computed_tokens before the step).
    `sample_seq_ids` receive a token sampled from this chunk's last logits row.
    """

    seq_id: str
    token_ids: tuple[int, ...]
    start_pos: int
    block_table: tuple[int, ...]
    slot_mapping: tuple[int, ...]
    sample_seq_ids: tuple[str, ...]

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


class NewSeq(NamedTuple):
    """A block table the runner writes whole."""

    seq_id: str
    block_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class SchedulerOutput:
    """One step's plan (see the module doc). The runner performs `copy_pairs` (src, dst block
    copies) before the forward pass."""

    seq_ids: tuple[str, ...]
    start_positions: tuple[int, ...]
    token_ids: tuple[int, ...]
    num_decodes: int
    prefill_lens: tuple[int, ...]
    prefill_samples: tuple[tuple[str, ...], ...]
    block_tables: tuple[tuple[int, ...], ...]
    new_seqs: tuple[NewSeq, ...]
    new_block_ids: tuple[tuple[str, tuple[int, ...]], ...]
    finished_seq_ids: tuple[str, ...]
    copy_pairs: tuple[tuple[int, int], ...]
    num_batched_tokens: int
    preempted_seq_ids: tuple[str, ...]
    block_size: int

    @property
    def is_empty(self) -> bool:
        return not self.seq_ids

    @property
    def query_lens(self) -> tuple[int, ...]:
        """[B] tokens of every scheduled sequence."""
        return (1,) * self.num_decodes + self.prefill_lens

    def sample_groups(self) -> Iterator[tuple[str, ...]]:
        """The sequences sampling from each logits row, in row order."""
        yield from zip(islice(self.seq_ids, self.num_decodes))  # (seq_id,) per decode
        yield from filter(None, self.prefill_samples)

    @property
    def num_sampled_rows(self) -> int:
        return self.num_decodes + sum(map(bool, self.prefill_samples))

    @property
    def chunks(self) -> tuple[ScheduledChunk, ...]:
        """The plan as one `ScheduledChunk` per sequence (built on each call: for tests and
        tools, not the step's hot path)."""
        lens, bs = self.query_lens, self.block_size
        samples = chain(zip(islice(self.seq_ids, self.num_decodes)), self.prefill_samples)
        chunks, offset = [], 0
        for seq_id, start, size, table, sample in zip(
            self.seq_ids, self.start_positions, lens, self.block_tables, samples, strict=True
        ):
            positions = range(start, start + size)
            slots = tuple(table[pos // bs] * bs + pos % bs for pos in positions)
            tokens = self.token_ids[offset : offset + size]
            chunks.append(ScheduledChunk(seq_id, tokens, start, table, slots, sample))
            offset += size
        return tuple(chunks)


def plan_of_chunks(
    chunks: Sequence[ScheduledChunk],
    *,
    block_size: int,
    new_seqs: Sequence[NewSeq] = (),
    finished_seq_ids: Sequence[str] = (),
    copy_pairs: Sequence[tuple[int, int]] = (),
) -> SchedulerOutput:
    """A plan of whole chunks (drivers without a scheduler: warm-up, tests). The leading run of
    one-token chunks that sample their own sequence is the decode section."""
    num_decodes = 0
    for chunk in chunks:
        if len(chunk.token_ids) != 1 or tuple(chunk.sample_seq_ids) != (chunk.seq_id,):
            break
        num_decodes += 1
    rest = chunks[num_decodes:]
    tokens = tuple(chain.from_iterable(chunk.token_ids for chunk in chunks))
    return SchedulerOutput(
        seq_ids=tuple(chunk.seq_id for chunk in chunks),
        start_positions=tuple(chunk.start_pos for chunk in chunks),
        token_ids=tokens,
        num_decodes=num_decodes,
        prefill_lens=tuple(len(chunk.token_ids) for chunk in rest),
        prefill_samples=tuple(tuple(chunk.sample_seq_ids) for chunk in rest),
        block_tables=tuple(tuple(chunk.block_table) for chunk in chunks),
        new_seqs=tuple(new_seqs),
        new_block_ids=(),
        finished_seq_ids=tuple(finished_seq_ids),
        copy_pairs=tuple(copy_pairs),
        num_batched_tokens=len(tokens),
        preempted_seq_ids=(),
        block_size=block_size,
    )
