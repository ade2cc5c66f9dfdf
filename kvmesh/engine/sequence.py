"""Sequences and requests: the per-request state the scheduler advances step by step.

A `Request` holds one `Sequence` until its prompt is computed; with `n > 1` it then holds the
`n` forked children (the original is child 0). Token bookkeeping of one sequence:

    all_token_ids = prompt_ids + output_ids
    [0, num_computed_tokens)              KV in the cache
    [num_computed_tokens, num_tokens)     still to compute (the prompt, or the last sampled token)

A sequence whose every token is computed after a step receives a sampled token.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvmesh.engine.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    """Lifecycle: WAITING -> RUNNING -> FINISHED_* (or PREFILLED in prefill-only mode; or
    WAITING_FOR_REMOTE_KV -> RUNNING when the prompt's KV comes from another worker)."""

    WAITING = "waiting"
    WAITING_FOR_REMOTE_KV = "waiting_for_remote_kv"  # blocks held, the KV arriving; not scheduled
    RUNNING = "running"
    PREFILLED = "prefilled"  # prompt computed, first token sampled, blocks held for transfer
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH = "finished_length"
    FINISHED_ABORTED = "finished_aborted"

    @property
    def is_finished(self) -> bool:
        return self in _FINISHED


_FINISHED = frozenset(
    {
        SequenceStatus.FINISHED_STOPPED,
        SequenceStatus.FINISHED_LENGTH,
        SequenceStatus.FINISHED_ABORTED,
    }
)
FINISH_STATUS = {
    "stop": SequenceStatus.FINISHED_STOPPED,
    "length": SequenceStatus.FINISHED_LENGTH,
    "abort": SequenceStatus.FINISHED_ABORTED,
}


@dataclass(eq=False, slots=True)
class Sequence:
    """One generation stream. Append tokens only through `append_token`."""

    seq_id: str
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    output_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    status: SequenceStatus = SequenceStatus.WAITING
    arrival_time: float = field(default_factory=time.monotonic)
    first_token_time: float | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None  # stop token id or stop string
    extra_key: bytes | None = None  # prefix-cache salt (adapter, tenant)
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache (first admission)
    num_preemptions: int = 0
    # set by the scheduler at admission so the per-token stop check is two comparisons:
    token_limit: int = 0  # most tokens (prompt + output) this sequence may reach
    stop_token_set: frozenset[int] = frozenset()  # tokens that may end it (stop ids, EOS)
    # prompt then output ids, kept in step by `append_token`; read it, never mutate it
    all_token_ids: list[int] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.all_token_ids = [*self.prompt_ids, *self.output_ids]

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_ids)

    @property
    def last_token_id(self) -> int:
        return self.all_token_ids[-1]

    def append_token(self, token_id: int) -> None:
        self.output_ids.append(token_id)
        self.all_token_ids.append(token_id)
        if self.first_token_time is None:
            self.first_token_time = time.monotonic()

    def finish(self, reason: str, stop_reason: int | str | None = None) -> None:
        """Mark finished with `reason` in FINISH_STATUS; the scheduler frees the blocks."""
        self.status = FINISH_STATUS[reason]
        self.finish_reason = reason
        self.stop_reason = stop_reason

    def fork(self, seq_id: str) -> Sequence:
        """A child with the same tokens and progress (its blocks are forked by the scheduler)."""
        child = Sequence(
            seq_id=seq_id,
            request_id=self.request_id,
            prompt_ids=self.prompt_ids,
            params=self.params,
            output_ids=list(self.output_ids),
            num_computed_tokens=self.num_computed_tokens,
            status=self.status,
            arrival_time=self.arrival_time,
            first_token_time=self.first_token_time,
            extra_key=self.extra_key,
            num_cached_tokens=self.num_cached_tokens,
            token_limit=self.token_limit,
            stop_token_set=self.stop_token_set,
        )
        return child


CHILD_SEPARATOR = "#"
"""Joins a request id and a child index into the child's sequence id. No request id contains
it (`add_request` refuses one that does), so no request id can name another's child."""


def child_seq_id(request_id: str, index: int) -> str:
    """Sequence id of child `index` of a request (child 0 keeps the request id)."""
    return request_id if index == 0 else f"{request_id}{CHILD_SEPARATOR}{index}"


@dataclass(eq=False)
class Request:
    """A client request: one sequence before its prompt is computed, `params.n` after.

    `prefill_only` requests stop in PREFILLED after their first token, holding their blocks
    until `Scheduler.release_prefilled` (the prefill role of disaggregated serving).
    """

    request_id: str
    seqs: list[Sequence]
    params: SamplingParams
    arrival_time: float = field(default_factory=time.monotonic)
    prefill_only: bool = False

    @classmethod
    def from_prompt(
        cls,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        *,
        arrival_time: float | None = None,
        extra_key: bytes | None = None,
        prefill_only: bool = False,
    ) -> Request:
        """A new request with its single sequence (seq_id == request_id)."""
        arrival = time.monotonic() if arrival_time is None else arrival_time
        seq = Sequence(
            seq_id=child_seq_id(request_id, 0),
            request_id=request_id,
            prompt_ids=list(prompt_ids),
            params=params,
            arrival_time=arrival,
            extra_key=extra_key,
        )
        return cls(request_id, [seq], params, arrival, prefill_only)

    @property
    def is_finished(self) -> bool:
        return all(seq.status.is_finished for seq in self.seqs)
