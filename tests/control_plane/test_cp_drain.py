"""Drain over real gRPC: in-flight streams get a bound sized from the longest of them (at most
--drain-seconds); one that cannot finish in it is cut with UNAVAILABLE "draining; retry"."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import grpc
import pytest
from cp_harness import Harness, control_plane, run_async, status_of, text_request
from cp_workers import FakeWorker
from google.rpc.error_details_pb2 import RetryInfo

from kvmesh.security import Security
from kvmesh.v1 import generation_pb2, wire


def retry_delay(trailers: grpc.aio.Metadata | None, details: str) -> int | None:
    """The retry delay of a failed call's trailers, as a client reads it; the pushback
    trailer, the legacy one and the RetryInfo detail must all say the same."""
    metadata = dict(trailers or ())
    error = grpc.aio.AioRpcError(
        grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), trailers or grpc.aio.Metadata(), details
    )
    pushback, legacy = metadata.get("grpc-retry-pushback-ms"), metadata.get("retry-after-ms")
    assert pushback == legacy, metadata
    details = [d for d in wire.status_details(error) if d.Is(RetryInfo.DESCRIPTOR)]
    assert len(details) == 1, metadata
    return wire.retry_delay_ms(error)


async def paced_pair(cp: Harness, tokens: int, pace: float) -> FakeWorker:
    await cp.add("p0", "prefill")
    decode = await cp.add("d0", "decode")
    decode.tokens, decode.pace = tokens, pace
    return decode


def request(max_tokens: int) -> generation_pb2.GenerateRequest:
    return text_request(sampling=generation_pb2.SamplingParams(max_tokens=max_tokens))


@run_async
async def test_a_stream_that_fits_the_bound_finishes_during_the_drain() -> None:
    async with control_plane(drain_seconds=20.0, drain_token_seconds=0.01) as cp:
        await paced_pair(cp, tokens=20, pace=0.05)  # about 1 s after the first token
        call = cp.generation.Generate(request(21), timeout=30)
        await asyncio.wait_for(call.read(), 5)
        await asyncio.sleep(0.2)  # a few tokens: the run has its own pace
        bound = cp.server.front_door.drain_bound(20.0)
        assert 0.5 < bound < 3.0, bound  # sized from the stream, far below the cap
        reader = asyncio.create_task(status_of(call))
        started = time.monotonic()
        await cp.server.drain()
        assert time.monotonic() - started < bound
        code, _, responses = await reader
        assert code == grpc.StatusCode.OK and len(responses) == 20


@run_async
async def test_a_stream_longer_than_the_cap_is_cut_with_draining_retry() -> None:
    async with control_plane(drain_seconds=0.5) as cp:
        decode = await paced_pair(cp, tokens=1000, pace=0.05)  # 50 s
        call = cp.generation.Generate(request(1001), timeout=60)
        await asyncio.wait_for(call.read(), 5)
        reader = asyncio.create_task(status_of(call))
        started = time.monotonic()
        await cp.server.drain()
        assert time.monotonic() - started < 0.5 + 2.0
        code, details, _ = await reader
        assert code == grpc.StatusCode.UNAVAILABLE
        assert "draining" in details and "retry" in details
        trailers = await call.trailing_metadata()
        assert retry_delay(trailers, details) == cp.server.config.retry_after_ms
        assert decode.held == {} and len(cp.server.cluster.ledger) == 0


@run_async
async def test_new_requests_during_a_drain_are_refused_with_retry_after() -> None:
    async with control_plane(drain_seconds=5.0) as cp:
        await paced_pair(cp, tokens=40, pace=0.05)
        running = cp.generation.Generate(request(41), timeout=30)
        await asyncio.wait_for(running.read(), 5)
        drain = asyncio.create_task(cp.server.drain())
        await asyncio.sleep(0.1)
        call = cp.generation.Generate(request(4), timeout=5)
        code, details, _ = await status_of(call)
        metadata = await call.trailing_metadata()
        assert code == grpc.StatusCode.UNAVAILABLE and "draining" in details
        assert retry_delay(metadata, details) == cp.server.config.retry_after_ms
        code, _, _ = await status_of(running)
        assert code == grpc.StatusCode.OK
        await drain


@run_async
async def test_an_http_stream_cut_by_the_drain_ends_with_a_draining_error() -> None:
    """The OpenAI client reading an SSE stream the drain cut raises APIError saying why."""
    import openai

    async with control_plane(drain_seconds=0.5, http_port=0) as cp:
        await paced_pair(cp, tokens=1000, pace=0.05)
        assert cp.server.http is not None
        api = openai.AsyncOpenAI(base_url=f"{cp.server.http.url}/v1", api_key="unused",
                                 max_retries=0)  # fmt: skip
        stream = await api.completions.create(model="tiny", prompt="hi", max_tokens=1001,
                                              stream=True)  # fmt: skip
        chunks = aiter(stream)
        assert (await anext(chunks)).choices[0].text
        drain = asyncio.create_task(cp.server.drain())
        with pytest.raises(openai.APIError, match=r"draining.*retry"):
            async for _ in chunks:
                pass
        await drain
        assert len(cp.server.cluster.ledger) == 0


class LosingDecode(FakeWorker):
    """A decode worker lost before its first response (Decode fails UNAVAILABLE): the front
    door retries the request on another one."""

    async def Decode(  # type: ignore[override]
        self, request: object, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[object]:
        self._record("Decode", context)
        await context.abort(grpc.StatusCode.UNAVAILABLE, "connection reset")
        yield  # an async generator, as the servicer's method is


@run_async
async def test_a_drain_between_two_attempts_cuts_the_run() -> None:
    """A drain's cut that lands while a retry waits for the lost attempt's Release ends the
    run with "draining; retry" instead of starting the next attempt (before, that attempt
    ran and streamed on past the cut)."""
    async with control_plane() as cp:
        await cp.add("p0", "prefill")
        security = cp.server.config.security
        losing = await LosingDecode(
            "d0", "decode", security=Security(token=security.token, tls=security.tls)
        ).start()
        cp.workers.append(losing)
        await losing.register(cp.control)
        losing.release_delay = 1.0  # the retry waits on this Release
        spare = await cp.add("d1", "decode")
        spare.tokens, spare.pace = 40, 0.1
        call = cp.generation.Generate(text_request(request_id="r"), timeout=30)
        reader = asyncio.create_task(status_of(call))
        deadline = time.monotonic() + 5
        while "Release" not in losing.calls:
            assert time.monotonic() < deadline, losing.calls
            await asyncio.sleep(0.01)
        cp.server.front_door.cut_all("the control plane is draining; retry")
        code, details, _ = await reader
        assert code == grpc.StatusCode.UNAVAILABLE and "draining" in details, (code, details)
        assert "Reserve" not in spare.calls  # no attempt after the cut
