"""The scheduler's per-step plan for the runner: one `SchedulerOutput` of `ScheduledChunk`s."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

new_chunk = tuple.__new__  # new_chunk(ScheduledChunk, fields): skips NamedTuple's Python __new__


class ScheduledChunk(NamedTuple):
    """Tokens of one sequence computed in one step (immutable; a NamedTuple because one is built
    per running sequence per step and a tuple builds about 3x faster than a frozen dataclass:
    `bench/micro_choices.py`).

    `start_pos` is the position of `token_ids[0]` (== num_computed_tokens before the step).
    `sample_seq_ids` receive a token sampled from this chunk's last logits row: () for a
    non-final prefill chunk, (seq_id,) normally, all n children for the final prefill chunk of
    an n > 1 request.
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


@dataclass(frozen=True, slots=True)
class SchedulerOutput:
    """One step's plan: decode chunks first, then prefill chunks.

    The runner performs `copy_pairs` (src, dst block copies) before the forward pass.
    """

    chunks: tuple[ScheduledChunk, ...]
    copy_pairs: tuple[tuple[int, int], ...]
    num_batched_tokens: int
    preempted_seq_ids: tuple[str, ...]

    @property
    def is_empty(self) -> bool:
        return not self.chunks
