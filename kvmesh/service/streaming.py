"""Relay a request's RequestOutputs from the engine thread as DecodeResponses."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

from kvmesh.engine.outputs import RequestOutput
from kvmesh.service.convert import decode_responses
from kvmesh.v1 import worker_pb2


async def outputs_until_finished(
    sink: asyncio.Queue[RequestOutput], first: RequestOutput | None = None
) -> AsyncIterator[RequestOutput]:
    """Yield outputs until one is finished (the call's deadline or cancellation bounds it)."""
    if first is not None:
        yield first
        if first.finished:
            return
    while True:
        output = await sink.get()
        yield output
        if output.finished:
            return


async def responses(
    sink: asyncio.Queue[RequestOutput],
    started: float,
    first: RequestOutput | None = None,
    *,
    queue_seconds: float = 0.0,
    prefill_seconds: float = 0.0,
) -> AsyncIterator[worker_pb2.DecodeResponse]:
    """Responses until the request finished; the first carries the timings."""
    timed = False
    async for output in outputs_until_finished(sink, first):
        for response in decode_responses(output):
            if not timed:
                response.first_decode_seconds = time.monotonic() - started
                response.queue_seconds = queue_seconds
                response.prefill_seconds = prefill_seconds
                timed = True
            yield response
        if output.finished:
            return
