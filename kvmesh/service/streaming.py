"""Relay a request's RequestOutputs from its engine stream as DecodeResponses."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from opentelemetry import trace

from kvmesh.engine.async_engine import RequestStream
from kvmesh.engine.outputs import RequestOutput
from kvmesh.service.convert import add_prompt_scores, decode_responses
from kvmesh.v1 import worker_pb2

TOKENS_GENERATED = "kvmesh.tokens_generated"


async def responses(
    stream: RequestStream,
    started: float | Callable[[], float],
    first: RequestOutput | None = None,
    *,
    queue_seconds: float = 0.0,
    prefill_seconds: float = 0.0,
    tokenizer: Any = None,
) -> AsyncIterator[worker_pb2.DecodeResponse]:
    """Responses for `first` (already taken from the stream), then the rest of the stream
    until the request finished; the first response carries the timings (its first decode
    counted from `started`, or from what `started()` returns when it comes). With `tokenizer`,
    logprobs carry their tokens' text. The current (server) span gets a `first_token` event
    and, at the end, `kvmesh.tokens_generated` (all completions together)."""
    timed = False
    span = trace.get_current_span()
    tokens = 0

    async def outputs() -> AsyncIterator[RequestOutput]:
        if first is not None:
            yield first
            if first.finished:
                return
        async for output in stream:
            yield output

    try:
        async for output in outputs():
            for response in decode_responses(output, tokenizer):
                if not timed:
                    since = started() if callable(started) else started
                    response.first_decode_seconds = max(0.0, time.monotonic() - since)
                    response.queue_seconds = queue_seconds
                    response.prefill_seconds = prefill_seconds
                    add_prompt_scores(response, output, tokenizer)  # computed here (colocated)
                    timed = True
                if response.token_ids and not tokens:
                    span.add_event("first_token", {"kvmesh.completion.index": response.index})
                tokens += len(response.token_ids)
                yield response
    finally:
        if span.is_recording():  # not when the call's span already ended (a cancelled call)
            span.set_attribute(TOKENS_GENERATED, tokens)
