"""What `LLM.generate` and the async engine return, in the shape vLLM users know.

`CompletionOutput` is one generated sequence (n of them per request), cumulative: token_ids
and text so far. `new_token_ids` / `new_text` hold only what this output adds to the previous
one of the same sequence (what a streaming client forwards). Times are `time.monotonic()`.
Each logprobs entry is a `TokenLogprobs`, which reads as vLLM's `dict[int, Logprob]` too
(`kvmesh.engine.logprobs`; `Logprob` is importable from here and from `kvmesh`).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field, replace

from kvmesh.engine.logprobs import Logprob, TokenLogprobs

__all__ = [
    "CompletionOutput",
    "Logprob",
    "RequestMetrics",
    "RequestOutput",
    "TokenLogprobs",
]


@dataclass
class CompletionOutput:
    """One sequence of a request. finish_reason: None while running, else stop|length|abort
    (error: its request failed in the engine, see `RequestOutput.error`);
    stop_reason: the stop string or stop token id that ended it (None for EOS and the rest).
    cumulative_logprob: the sum of the sampled tokens' logprobs when logprobs were asked for,
    else None (vLLM's field)."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[TokenLogprobs] | None = None
    cumulative_logprob: float | None = None
    new_token_ids: list[int] = field(default_factory=list)
    new_text: str = ""
    new_finish: bool = False  # finish_reason set since the previous output (a delta, as above)
    token_times: list[float] = field(default_factory=list)  # when each output token was made

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def inter_token_latencies(self) -> list[float]:
        """Seconds between consecutive output tokens (len(token_ids) - 1 values)."""
        times = self.token_times
        return [b - a for a, b in itertools.pairwise(times)]


@dataclass
class RequestMetrics:
    """Request timings: arrival, first token and finish (monotonic seconds)."""

    arrival_time: float
    first_token_time: float | None = None
    finished_time: float | None = None

    @property
    def ttft(self) -> float | None:
        """Time to first token in seconds, None until the first token exists."""
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time


@dataclass
class RequestOutput:
    """Everything about one request so far; `finished` when every sequence has finished.
    `prompt_logprobs` (when asked for, once the whole prompt is scored): one entry per prompt
    token, None for the first. `error` (a `RequestFailedError`, in the final output only): the
    request raised in the engine's step and was aborted there; the others went on."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    num_cached_tokens: int = 0
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    error: Exception | None = None


def merge_unread(older: RequestOutput, newer: RequestOutput) -> RequestOutput:
    """One output standing for `older` then `newer` of the same request, for a reader that has
    read neither: `newer`'s state with each completion's deltas (new token ids, new text, a
    new finish) since before `older`. Neither argument is changed."""
    earlier = {out.index: out for out in older.outputs}
    outputs = []
    for out in newer.outputs:
        prev = earlier.pop(out.index, None)
        if prev is not None:
            out = replace(
                out,
                new_token_ids=prev.new_token_ids + out.new_token_ids,
                new_text=prev.new_text + out.new_text,
                new_finish=prev.new_finish or out.new_finish,
            )
        outputs.append(out)
    assert not earlier, "a later output keeps every completion of an earlier one"
    scored = newer.prompt_logprobs if newer.prompt_logprobs is not None else older.prompt_logprobs
    return replace(newer, outputs=outputs, prompt_logprobs=scored)
