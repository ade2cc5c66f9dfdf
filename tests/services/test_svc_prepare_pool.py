"""The prepare pool: small prompts never wait behind large ones, the large lane is bounded
(RESOURCE_EXHAUSTED beyond it), and its count survives callers that went away."""

from __future__ import annotations

import asyncio
import threading
import time

import grpc
import pytest

from kvmesh.service.prepare_pool import LARGE_PROMPT_BYTES, PreparePool
from kvmesh.service.status import ServiceError

LARGE = LARGE_PROMPT_BYTES + 1


def test_large_lane_is_bounded_and_small_prompts_pass_it() -> None:
    async def scenario() -> None:
        pool = PreparePool(small_threads=1, large_threads=2, max_large_waiting=1)
        release = threading.Event()
        try:
            held = [asyncio.ensure_future(pool.run(LARGE, lambda: release.wait(10)))
                    for _ in range(3)]  # fmt: skip
            await asyncio.sleep(0.05)
            assert pool.large_busy == 3
            with pytest.raises(ServiceError) as caught:
                await pool.run(LARGE, lambda: None)
            assert caught.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert caught.value.message.startswith("prompt: ")
            started = time.monotonic()
            assert await pool.run(100, lambda: "small") == "small"  # not behind the large ones
            assert time.monotonic() - started < 1.0
            held[2].cancel()  # waiting, never started: counted down by the cancellation
            await asyncio.sleep(0.05)
            assert pool.large_busy == 2
            release.set()
            assert await asyncio.gather(*held[:2]) == [True, True]
            assert pool.large_busy == 0
            assert await pool.run(LARGE, lambda: "again") == "again"
        finally:
            release.set()
            pool.close()

    asyncio.run(scenario())


def test_a_caller_that_goes_away_keeps_its_slot_until_the_thread_ends() -> None:
    async def scenario() -> None:
        pool = PreparePool(small_threads=1, large_threads=1, max_large_waiting=0)
        release = threading.Event()
        try:
            running = asyncio.ensure_future(pool.run(LARGE, lambda: release.wait(10)))
            await asyncio.sleep(0.05)
            running.cancel()  # the thread goes on: its slot stays taken
            await asyncio.sleep(0.05)
            assert pool.large_busy == 1
            with pytest.raises(ServiceError):
                await pool.run(LARGE, lambda: None)
            release.set()
            deadline = time.monotonic() + 5
            while pool.large_busy and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            assert pool.large_busy == 0
        finally:
            release.set()
            pool.close()

    asyncio.run(scenario())
