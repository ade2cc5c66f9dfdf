"""The scheduler's configuration and its per-step plan (`SchedulerOutput`) for the runner."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from kvmesh.engine.errors import InvalidParameterError

POLICIES = ("continuous", "static")
ALLOCATIONS = ("paged", "contiguous")
SCHEDULING_POLICIES = ("decode-first", "prefill-first")


@dataclass(frozen=True, kw_only=True)
class SchedulerConfig:
    """Batching limits and policy.

    policy "continuous": requests join and leave at every step. "static" (baseline): a batch is
    admitted when nothing runs and runs until its longest member finishes.
    allocation "paged": blocks on demand. "contiguous" (baseline): blocks for prompt +
    max_tokens (or max_model_len) reserved at admission, as contiguous preallocation would.
    scheduling_policy "decode-first" (vLLM's order): every step runs one token of each running
    decode, then prompt chunks. "prefill-first" (SGLang's order): a step that can start or
    continue prompt work holds only prompt chunks, until the prompt tokens computed while
    running decodes wait reach `max_decode_stall_tokens`;
    the next step is then decode-first. See `kvmesh.engine.scheduler`.
    """

    max_model_len: int
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int | None = None  # cap on one prefill chunk
    enable_prefix_caching: bool = True
    policy: str = "continuous"
    allocation: str = "paged"
    scheduling_policy: str = "decode-first"
    max_decode_stall_tokens: int = 512  # prefill-first only
    eos_token_id: int | None = None

    def __post_init__(self) -> None:
        positive = ("max_model_len", "max_num_seqs", "max_num_batched_tokens")
        for name in (*positive, "max_decode_stall_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise InvalidParameterError(name, f"must be a positive int, got {value!r}")
        threshold = self.long_prefill_token_threshold
        if threshold is not None and (not isinstance(threshold, int) or threshold <= 0):
            raise InvalidParameterError(
                "long_prefill_token_threshold", f"must be a positive int or None, got {threshold!r}"
            )
        if self.policy not in POLICIES:
            raise InvalidParameterError("policy", f"must be one of {POLICIES}, got {self.policy!r}")
        if self.allocation not in ALLOCATIONS:
            raise InvalidParameterError(
                "allocation", f"must be one of {ALLOCATIONS}, got {self.allocation!r}"
            )
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise InvalidParameterError(
                "scheduling_policy",
                f"must be one of {SCHEDULING_POLICIES}, got {self.scheduling_policy!r}",
            )
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise InvalidParameterError(
                "max_num_batched_tokens",
                f"must be >= max_model_len={self.max_model_len} without chunked prefill,"
                f" got {self.max_num_batched_tokens}",
            )


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
