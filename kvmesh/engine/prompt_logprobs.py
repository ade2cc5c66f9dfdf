"""Prompt logprobs (SamplingParams.prompt_logprobs): each prompt token's raw-model logprob
given the tokens before it, its rank and the top-k there, as vLLM's RequestOutput has them.

The prompt's positions run in prefill chunks like any other; the rows of a chunk whose
request owes prompt logprobs are kept from the step's hidden states, and the engine scores
them here after the forward: logits in slices of SLICE_ROWS (a [rows, vocab] tensor for a long
prompt would be large), `raw_logprobs` at the next prompt token. Rows are taken in position
order from where the request's entries stop, so a prompt recomputed after a preemption is not
scored twice. Such a prompt is never read from the prefix cache (the scheduler skips the
lookup while they are owed): a cached position has no hidden state to score.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch

from kvmesh.engine.sampler import TokenLogprobs, raw_logprobs
from kvmesh.engine.scheduler import SchedulerOutput

SLICE_ROWS = 128


@dataclass
class PromptLogprobs:
    """One request's prompt logprobs so far: entries[p] scores prompt token p (None for the
    first, which has no context); complete once there is one entry per prompt token."""

    top: int
    prompt_ids: list[int]
    entries: list[TokenLogprobs | None] = field(default_factory=lambda: [None])

    @property
    def complete(self) -> bool:
        return len(self.entries) >= len(self.prompt_ids)

    @property
    def next_position(self) -> int:
        """The position whose logits score the next entry's token (position + 1)."""
        return len(self.entries) - 1


@dataclass
class PromptRows:
    """The flat rows of one step that score prompt tokens, in position order per request."""

    rows: list[int] = field(default_factory=list)  # flat token rows of the step's batch
    targets: list[int] = field(default_factory=list)  # the prompt token each row scores
    owners: list[PromptLogprobs] = field(default_factory=list)  # whose entry each row adds


def rows_of_step(plan: SchedulerOutput, owing: Mapping[str, PromptLogprobs]) -> PromptRows | None:
    """The rows of `plan`'s prefill chunks that score prompt tokens still owed (`owing`: by
    the prompt's sequence id); None when there are none."""
    if not owing:
        return None
    found = PromptRows()
    offset = plan.num_decodes  # decodes come first, one row each
    chunks = zip(
        plan.seq_ids[plan.num_decodes :],
        plan.start_positions[plan.num_decodes :],
        plan.prefill_lens,
        strict=True,
    )
    for seq_id, start, size in chunks:
        state = owing.get(seq_id)
        if state is not None and not state.complete:
            first = state.next_position
            assert start <= first, "an owed prompt's positions are computed in order"
            last = min(start + size, len(state.prompt_ids) - 1)  # the last token scores none
            for position in range(first, last):
                found.rows.append(offset + position - start)
                found.targets.append(state.prompt_ids[position + 1])
                found.owners.append(state)
        offset += size
    return found if found.rows else None


def score(
    rows: PromptRows, hidden: torch.Tensor, compute_logits: Callable[[torch.Tensor], torch.Tensor]
) -> None:
    """Append each row's entry to its owner: hidden [len(rows.rows), hidden] are the rows'
    final hidden states, in order; `compute_logits` maps them to [rows, vocab] logits."""
    top = max(owner.top for owner in rows.owners)
    targets = torch.tensor(rows.targets, dtype=torch.int64, device=hidden.device)  # [R]
    for lo in range(0, len(rows.rows), SLICE_ROWS):
        hi = min(lo + SLICE_ROWS, len(rows.rows))
        logits = compute_logits(hidden[lo:hi])  # [r, vocab]
        found = raw_logprobs(logits, targets[lo:hi], top)
        logprob, rank = found.token_logprob.tolist(), found.token_rank.tolist()
        top_ids, top_values = found.top_ids.tolist(), found.top_logprobs.tolist()
        for j in range(hi - lo):
            owner = rows.owners[lo + j]
            owner.entries.append(
                TokenLogprobs(
                    sampled_token_id=rows.targets[lo + j],
                    sampled_logprob=logprob[j],
                    sampled_rank=rank[j],
                    top_token_ids=tuple(top_ids[j][: owner.top]),
                    top_logprobs=tuple(top_values[j][: owner.top]),
                )
            )
