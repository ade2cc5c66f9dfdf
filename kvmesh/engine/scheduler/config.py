"""The scheduler's configuration: batching limits and the names of its policies."""

from __future__ import annotations

from dataclasses import dataclass

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
    max_tokens (or max_model_len) less one, every slot the sequence can write (the last sampled
    token's KV is never written), reserved at admission, as contiguous preallocation would.
    scheduling_policy "decode-first" (vLLM's order): every step runs one token of each running
    decode, then prompt chunks. "prefill-first" (SGLang's order): a step that can start or
    continue prompt work holds only prompt chunks, until the prompt tokens computed while
    running decodes wait reach `max_decode_stall_tokens`;
    the next step is then decode-first. See `kvmesh.engine.scheduler`.
    eos_token_ids: every end-of-sequence id of the model (generation_config may list several);
    each ends a sequence with finish_reason "stop" once min_tokens are out, unless ignore_eos.
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
    preemption: str = "recompute"  # or "swap" / "auto" (with a host KV tier)
    max_decode_stall_tokens: int = 512  # prefill-first only
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        positive = ("max_model_len", "max_num_seqs", "max_num_batched_tokens")
        for name in (*positive, "max_decode_stall_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise InvalidParameterError(name, f"must be a positive int, got {value!r}")
        eos = self.eos_token_ids
        if not isinstance(eos, tuple) or not all(_is_id(token) for token in eos):
            raise InvalidParameterError(
                "eos_token_ids", f"must be a tuple of non-negative ints, got {eos!r}"
            )
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


def _is_id(token: object) -> bool:
    return isinstance(token, int) and not isinstance(token, bool) and token >= 0
