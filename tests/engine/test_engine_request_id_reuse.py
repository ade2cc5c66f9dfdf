"""A caller that reuses another caller's request id on one AsyncLLMEngine (the engine each
worker serves requests on) cannot touch the request that holds the id: its own open is refused
(InvalidParameterError naming request_id), and the cleanup of its stream, when it gives up
(cancel, timeout) or closes a stream whose request already ended, never aborts the holder."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest

from kvmesh.engine.async_engine import AsyncLLMEngine, RequestStream
from kvmesh.engine.config import EngineConfig
from kvmesh.engine.errors import InvalidParameterError
from kvmesh.engine.sampling_params import SamplingParams
from kvmesh.models.tiny import build_tiny_model

NUM_BLOCKS = 64
LONG = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("qwen2"), "qwen2", "test", seed=0)


def hold_engine_thread(engine: AsyncLLMEngine) -> threading.Event:
    """Queue a command that keeps the engine thread busy until the returned event is set: a
    command queued meanwhile (an open) waits behind it, as behind a long step."""
    gate = threading.Event()
    engine.submit(lambda e: gate.wait(30))
    return gate


async def runs_to_its_length(engine: AsyncLLMEngine, stream: RequestStream) -> None:
    """Read `stream` to its end: its request finished "length" with all LONG.max_tokens
    tokens, and every KV block of `engine` is free again."""
    last = None
    async for output in stream:
        last = output
    assert last is not None
    assert last.outputs[0].finish_reason == "length"
    assert len(last.outputs[0].token_ids) == LONG.max_tokens
    assert await free_blocks(engine) == NUM_BLOCKS


async def still_held(engine: AsyncLLMEngine, request_id: str) -> bool:
    """The engine still runs `request_id` (asked after every command queued before)."""
    return await engine.call(lambda e: e.scheduler.get_request(request_id) is not None)


async def free_blocks(engine: AsyncLLMEngine) -> int:
    return await engine.call(lambda e: e.scheduler.block_manager.num_free_blocks)


@pytest.mark.parametrize("gives_up", ["cancelled", "timed out"])
def test_a_duplicate_open_given_up_leaves_the_holder_running(
    checkpoint: Path, gives_up: str
) -> None:
    """Caller B opens the id caller A's running request holds; B's open is still queued when
    B gives up. A's request runs to its own end (length, every token), and its blocks return."""

    async def scenario() -> None:
        engine = AsyncLLMEngine(EngineConfig(model=str(checkpoint), num_kv_blocks=NUM_BLOCKS))
        try:
            held = await engine.add_request("shared", list(range(10, 30)), LONG)
            assert not (await anext(held)).finished
            gate = hold_engine_thread(engine)
            if gives_up == "cancelled":
                other = asyncio.ensure_future(engine.add_request("shared", [40, 41, 42], LONG))
                await asyncio.sleep(0.1)  # B's open is queued behind the busy engine thread
                other.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await other
            else:
                engine.call_timeout = 0.1
                with pytest.raises(TimeoutError):
                    await engine.add_request("shared", [40, 41, 42], LONG)
                engine.call_timeout = 60.0
            gate.set()
            assert await still_held(engine, "shared")  # B's cleanup ran before this
            await runs_to_its_length(engine, held)
            assert engine.num_unfinished == 0
        finally:
            await engine.shutdown()

    asyncio.run(asyncio.wait_for(scenario(), timeout=120))


def test_a_duplicate_open_is_refused_naming_request_id(checkpoint: Path) -> None:
    """B's open of a held id is refused, naming the field; A's request is untouched."""

    async def scenario() -> None:
        engine = AsyncLLMEngine(EngineConfig(model=str(checkpoint), num_kv_blocks=NUM_BLOCKS))
        try:
            held = await engine.add_request("shared", list(range(10, 30)), LONG)
            with pytest.raises(InvalidParameterError) as refused:
                await engine.add_request("shared", [40, 41, 42], LONG)
            assert refused.value.field == "request_id"
            await runs_to_its_length(engine, held)
        finally:
            await engine.shutdown()

    asyncio.run(asyncio.wait_for(scenario(), timeout=120))


def test_closing_a_stream_whose_request_ended_leaves_a_newer_holder_running(
    checkpoint: Path,
) -> None:
    """A's request is aborted by id (as a colocated worker's Release does) while A's caller is
    not reading; the id is free and B's request takes it; A's caller then leaves its stream
    (unread end: not finished to it). B's request runs to its own end."""

    async def scenario() -> None:
        engine = AsyncLLMEngine(EngineConfig(model=str(checkpoint), num_kv_blocks=NUM_BLOCKS))
        try:
            first = await engine.add_request("shared", list(range(10, 30)), LONG)
            assert not (await anext(first)).finished
            assert await engine.abort("shared") is True
            second = await engine.add_request("shared", [40, 41, 42], LONG)
            await first.aclose()  # A leaves; its aborted end was never read
            assert await still_held(engine, "shared")
            await runs_to_its_length(engine, second)
            assert engine.num_unfinished == 0
        finally:
            await engine.shutdown()

    asyncio.run(asyncio.wait_for(scenario(), timeout=120))


def test_an_open_given_up_still_cleans_up_its_own_request(checkpoint: Path) -> None:
    """The cleanup still runs for the stream that holds the id: a caller cancelled while its
    own (unique) open is queued leaves nothing behind, and so does one leaving its stream."""

    async def scenario() -> None:
        engine = AsyncLLMEngine(EngineConfig(model=str(checkpoint), num_kv_blocks=NUM_BLOCKS))
        try:
            gate = hold_engine_thread(engine)
            mine = asyncio.ensure_future(engine.add_request("mine", list(range(10, 30)), LONG))
            await asyncio.sleep(0.1)
            mine.cancel()
            with pytest.raises(asyncio.CancelledError):
                await mine
            gate.set()
            assert not await still_held(engine, "mine")
            left = await engine.add_request("left", list(range(10, 30)), LONG)
            assert not (await anext(left)).finished
            await left.aclose()
            assert not await still_held(engine, "left")
            assert await free_blocks(engine) == NUM_BLOCKS
            assert engine.num_unfinished == 0
        finally:
            await engine.shutdown()

    asyncio.run(asyncio.wait_for(scenario(), timeout=120))
