"""Relay a request's RequestOutputs from its engine stream as DecodeResponses."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from kvmesh.engine.async_engine import RequestStream
from kvmesh.engine.outputs import RequestOutput
from kvmesh.service.convert import decode_responses
from kvmesh.v1 import worker_pb2


async def responses(
    stream: RequestStream,
    started: float,
    first: RequestOutput | None = None,
    *,
    queue_seconds: float = 0.0,
    prefill_seconds: float = 0.0,
    tokenizer: Any = None,
) -> AsyncIterator[worker_pb2.DecodeResponse]:
    """Responses for `first` (already taken from the stream), then the rest of the stream
    until the request finished; the first response carries the timings. With `tokenizer`,
    logprobs carry their tokens' text."""
    timed = False

    async def outputs() -> AsyncIterator[RequestOutput]:
        if first is not None:
            yield first
            if first.finished:
                return
        async for output in stream:
            yield output

    async for output in outputs():
        for response in decode_responses(output, tokenizer):
            if not timed:
                response.first_decode_seconds = time.monotonic() - started
                response.queue_seconds = queue_seconds
                response.prefill_seconds = prefill_seconds
                timed = True
            yield response
