"""Overload signalling of a real front door (admission full): RESOURCE_EXHAUSTED with the
`grpc-retry-pushback-ms` trailer and a RetryInfo detail, and the Python clients' bounded
retries on it (and on UNAVAILABLE before any response)."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest
from cp_harness import Harness, control_plane, run_async, status_of, text_request
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from kvmesh.client import (
    NO_RETRY,
    AsyncClient,
    Client,
    InvalidArgument,
    ResourceExhausted,
    RetryPolicy,
    Unavailable,
)


async def block_admission(cp: Harness) -> asyncio.Event:
    """Fill the door (max_inflight=1) with a request whose decode waits on the returned gate."""
    await cp.add("p0", "prefill")
    decode = await cp.add("d0", "decode")
    decode.gate = asyncio.Event()
    call = cp.generation.Generate(text_request(request_id="holder"), timeout=20)
    await asyncio.wait_for(decode.stream_started.wait(), 5)
    cp.holder = call  # type: ignore[attr-defined]  # kept alive until the test ends
    return decode.gate


def refusals(cp: Harness, status: str = "RESOURCE_EXHAUSTED") -> float:
    counter = cp.server.cluster.metrics.requests.labels(status)
    return float(counter._value.get())


async def until(predicate: object, seconds: float = 5.0) -> None:
    deadline = time.monotonic() + seconds
    while not predicate():  # type: ignore[operator]
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.005)


@run_async
async def test_admission_full_sends_pushback_trailer_and_retry_info() -> None:
    async with control_plane(max_inflight=1, retry_after_ms=250) as cp:
        await block_admission(cp)
        call = cp.generation.Generate(text_request(), timeout=5)
        code, details, _ = await status_of(call)
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "in flight" in details
        trailers = list(await call.trailing_metadata())
        assert ("grpc-retry-pushback-ms", "250") in trailers
        assert ("retry-after-ms", "250") in trailers  # kept for older clients
        error = grpc.aio.AioRpcError(code, None, await call.trailing_metadata(), details)
        status = rpc_status.from_call(error)  # type: ignore[arg-type]
        assert status is not None
        info = error_details_pb2.RetryInfo()
        assert status.details[0].Unpack(info)
        assert info.retry_delay.ToMilliseconds() == 250


@run_async
async def test_async_client_retries_on_pushback_until_admitted() -> None:
    async with control_plane(max_inflight=1, retry_after_ms=100) as cp:
        gate = await block_admission(cp)
        retry = RetryPolicy(max_retries=20, max_wait_seconds=5.0)
        async with AsyncClient(cp.server.address, timeout=10, retry=retry) as client:
            answer = asyncio.create_task(client.complete("hi"))
            await until(lambda: refusals(cp) >= 2)  # refused, waited, refused again
            gate.set()  # the holder finishes: the next retry is admitted
            result = await asyncio.wait_for(answer, 5)
        assert result.finish_reason == "length" and result.token_ids
        assert 2 <= refusals(cp) <= 4


@run_async
async def test_async_client_retries_are_bounded_by_count_and_by_the_deadline() -> None:
    async with control_plane(max_inflight=1, retry_after_ms=100) as cp:
        await block_admission(cp)
        async with AsyncClient(cp.server.address, retry=RetryPolicy(max_retries=2)) as client:
            started = time.monotonic()
            with pytest.raises(ResourceExhausted) as caught:
                await client.complete("hi", timeout=10)
            assert 0.2 <= time.monotonic() - started < 2.0  # two waits of 100 ms
            assert caught.value.retry_after_ms == 100
            assert refusals(cp) == 3  # the call and two retries
            started = time.monotonic()
            with pytest.raises(ResourceExhausted):
                await client.complete("hi", timeout=0.15)  # room for one wait, not two
            assert time.monotonic() - started < 0.5
            assert refusals(cp) == 5
        async with AsyncClient(cp.server.address, retry=NO_RETRY) as client:
            with pytest.raises(ResourceExhausted):
                await client.complete("hi", timeout=5)
            assert refusals(cp) == 6


@run_async
async def test_sync_client_retries_on_pushback_until_admitted() -> None:
    async with control_plane(max_inflight=1, retry_after_ms=100) as cp:
        gate = await block_admission(cp)
        retry = RetryPolicy(max_retries=20, max_wait_seconds=5.0)
        with Client(cp.server.address, timeout=10, retry=retry) as client:
            answer = asyncio.create_task(asyncio.to_thread(client.complete, [1, 2, 3]))
            await until(lambda: refusals(cp) >= 2)
            gate.set()
            result = await asyncio.wait_for(answer, 5)
            assert result.finish_reason == "length"
            with pytest.raises(InvalidArgument):  # never retried
                await asyncio.to_thread(client.complete, "")
        assert refusals(cp, "INVALID_ARGUMENT") == 1


@run_async
async def test_client_retries_unavailable_before_any_response() -> None:
    async with control_plane() as cp:
        retry = RetryPolicy(max_retries=2, unavailable_backoff_seconds=0.05)
        async with AsyncClient(cp.server.address, timeout=5, retry=retry) as client:
            with pytest.raises(Unavailable):  # no workers: refused three times
                await client.complete("hi")
            assert refusals(cp, "UNAVAILABLE") == 3
        slow = RetryPolicy(max_retries=5, unavailable_backoff_seconds=0.2)
        async with AsyncClient(cp.server.address, timeout=5, retry=slow) as client:
            answer = asyncio.create_task(client.complete("x"))
            await until(lambda: refusals(cp, "UNAVAILABLE") >= 4)
            await cp.add("c0", "colocated")  # a worker arrives during the backoff
            result = await asyncio.wait_for(answer, 5)
            assert result.finish_reason == "length"
