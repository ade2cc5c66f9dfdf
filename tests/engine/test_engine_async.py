"""AsyncLLMEngine: streaming deltas, abort, early exit and bad input, on a real tiny model."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import pytest

from kvmesh.engine.async_engine import MERGE_BACKLOG, AsyncLLMEngine
from kvmesh.engine.config import EngineConfig
from kvmesh.engine.engine import LLMEngine
from kvmesh.engine.errors import InvalidParameterError
from kvmesh.engine.llm import LLM
from kvmesh.engine.sampling_params import SamplingParams
from kvmesh.engine.sequence import Request
from kvmesh.models.tiny import build_tiny_model

PROMPTS = ([11, 12, 13, 14, 15], [20, 21, 22, 23, 24, 25, 26, 27, 28])
PARAMS = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("qwen2"), "qwen2", "test", seed=0)


def test_streams_match_offline_and_abort_frees_blocks(checkpoint: Path) -> None:
    offline = LLM(str(checkpoint), num_kv_blocks=64).generate(list(PROMPTS), PARAMS)

    async def scenario() -> None:
        engine = AsyncLLMEngine(EngineConfig(model=str(checkpoint), num_kv_blocks=64))
        try:

            async def collect(request_id: str, prompt: list[int]) -> tuple[list[int], list[int]]:
                deltas: list[int] = []
                final: list[int] = []
                async for output in engine.generate(request_id, prompt, PARAMS):
                    deltas.extend(output.outputs[0].new_token_ids)
                    final = output.outputs[0].token_ids
                return deltas, final

            results = await asyncio.gather(
                *(collect(f"r{i}", list(p)) for i, p in enumerate(PROMPTS))
            )
            for (deltas, final), expected in zip(results, offline, strict=True):
                assert deltas == final == expected.outputs[0].token_ids

            long = SamplingParams(temperature=0.0, max_tokens=500, ignore_eos=True)
            async for _ in engine.generate("early", list(PROMPTS[0]), long):
                break  # leaving the stream aborts the request
            stream = engine.generate("aborted", list(PROMPTS[1]), long)
            await stream.__anext__()
            assert await engine.abort("aborted") is True
            last = [o async for o in stream]
            assert last[-1].finished and last[-1].outputs[0].finish_reason == "abort"
            assert await engine.abort("aborted") is False

            with pytest.raises(InvalidParameterError):
                await engine.add_request("bad", [1, 99999], PARAMS)
            bm = engine.engine.scheduler.block_manager
            assert (
                await engine.call(lambda e: e.scheduler.block_manager.num_free_blocks)
                == bm.num_blocks
            )
            assert engine.num_unfinished == 0
        finally:
            await engine.shutdown()

    asyncio.run(asyncio.wait_for(scenario(), timeout=120))


def test_calls_streams_load_and_shutdown(checkpoint: Path) -> None:
    """The interface the services use: calls at step boundaries in order, custom streams with
    their cleanup, a load snapshot fresh when a call returns, bounded waits, clean shutdown."""
    from kvmesh.engine import disagg
    from kvmesh.engine.async_engine import EngineDeadError

    async def scenario() -> None:
        engine = AsyncLLMEngine(EngineConfig(model=str(checkpoint), num_kv_blocks=64))
        total = engine.load().total_blocks
        try:
            held = Request.from_prompt("held", list(range(1, 41)), SamplingParams())
            blocks = await engine.call(disagg.reserve, held)
            assert blocks is not None and len(blocks) == 3
            assert engine.load().free_blocks == total - 3  # refreshed before the call returned
            with pytest.raises(InvalidParameterError):  # the command's exception comes back
                await engine.call(disagg.reserve, held)
            assert await engine.call(disagg.release, "held") is True
            assert engine.load().free_blocks == total

            with pytest.raises(TimeoutError):
                await engine.call(lambda e: __import__("time").sleep(0.3), timeout=0.05)
            assert await engine.call(lambda e: "after") == "after"  # commands keep their order

            cleaned: list[str] = []

            def cleanup(e: object, request_id: str) -> None:
                cleaned.append(request_id)
                engine.engine.abort_request(request_id)

            long = SamplingParams(temperature=0.0, max_tokens=500, ignore_eos=True)

            def start(e: LLMEngine) -> None:
                e.add_request("custom", list(PROMPTS[0]), long)

            stream = await engine.open_stream("custom", start, cleanup)
            assert not (await anext(stream)).finished
            await stream.aclose()
            assert cleaned == ["custom"] and engine.num_unfinished == 0
            assert engine.load().free_blocks == total

            open_stream = await engine.add_request("open", list(PROMPTS[1]), long)
            await anext(open_stream)
        finally:
            await engine.shutdown(timeout=10)
        assert not engine._thread.is_alive()
        with pytest.raises(EngineDeadError):
            async for _ in open_stream:
                pass
        with pytest.raises(EngineDeadError):
            await engine.call(lambda e: None)

    asyncio.run(asyncio.wait_for(scenario(), timeout=120))


def test_a_stream_started_from_another_thread(checkpoint: Path) -> None:
    """`open_stream_when`: the start runs on the engine thread once a foreign thread fires;
    its error ends the stream; a stream closed before the fire never starts its request."""
    import threading

    long = SamplingParams(temperature=0.0, max_tokens=500, ignore_eos=True)

    def fire_from_thread(fire: Callable[[], None]) -> None:
        threading.Timer(0.05, fire).start()

    async def scenario() -> None:
        engine = AsyncLLMEngine(EngineConfig(model=str(checkpoint), num_kv_blocks=64))
        total = engine.load().total_blocks
        ran_on: list[str] = []
        try:

            def start(e: LLMEngine) -> None:
                ran_on.append(threading.current_thread().name)
                e.add_request("fired", list(PROMPTS[0]), long)

            stream = engine.open_stream_when("fired", fire_from_thread, start)
            with pytest.raises(InvalidParameterError):  # one stream per request id
                engine.open_stream_when("fired", fire_from_thread, start)
            assert not (await anext(stream)).finished
            assert ran_on == [engine._thread.name]
            await stream.aclose()

            def bad(e: LLMEngine) -> None:
                raise InvalidParameterError("first_tokens", "refused")

            failing = engine.open_stream_when("bad", fire_from_thread, bad)
            with pytest.raises(InvalidParameterError, match="first_tokens"):
                await anext(failing)

            fires: list[Callable[[], None]] = []
            late: list[str] = []
            closed = engine.open_stream_when("closed", fires.append, lambda e: late.append("ran"))
            closed.close()
            fires[0]()  # after the close: the start must not run
            await engine.call(lambda e: None)  # commands run in order: the fired one ran before
            assert late == []
            assert engine.num_unfinished == 0
            assert engine.load().free_blocks == total
        finally:
            await engine.shutdown(timeout=10)

    asyncio.run(asyncio.wait_for(scenario(), timeout=120))


def test_a_failed_step_ends_every_stream(checkpoint: Path) -> None:
    from kvmesh.engine.async_engine import EngineDeadError

    async def scenario() -> None:
        engine = AsyncLLMEngine(EngineConfig(model=str(checkpoint), num_kv_blocks=64))
        try:

            def broken() -> list[object]:
                raise RuntimeError("kernel failed")

            await engine.call(lambda e: setattr(e, "step", broken))
            stream = await engine.add_request("doomed", list(PROMPTS[0]), PARAMS)
            with pytest.raises(EngineDeadError):
                await anext(stream)
            with pytest.raises(EngineDeadError):
                await engine.call(lambda e: None)
        finally:
            await engine.shutdown(timeout=5)

    asyncio.run(asyncio.wait_for(scenario(), timeout=60))


def _add(engine: LLMEngine, request_id: str, prompt: list[int], params: SamplingParams) -> None:
    engine.add_request(request_id, prompt, params)


def test_step_hook_sees_each_chunk_on_the_engine_thread(checkpoint: Path) -> None:
    """A per-stream hook runs after every step (before that step's outputs are handed out) and
    is dropped with the stream; one that raises is removed without harming the engine."""
    import threading

    prompt = list(range(10, 50))  # 40 tokens in chunks of 16

    async def scenario() -> None:
        config = EngineConfig(model=str(checkpoint), num_kv_blocks=64, max_num_batched_tokens=16)
        engine = AsyncLLMEngine(config)
        try:
            seen: list[tuple[int, bool]] = []
            threads: set[str] = set()

            def hook(e: LLMEngine, request_id: str, output: object) -> None:
                threads.add(threading.current_thread().name)
                request = e.scheduler.get_request(request_id)
                if request is not None:
                    seq = request.seqs[0]
                    seen.append((seq.num_computed_tokens, bool(seq.output_ids)))

            params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
            stream = await engine.open_stream(
                "h", lambda e: _add(e, "h", prompt, params), on_step=hook
            )
            first = await anext(stream)
            assert first.outputs[0].token_ids  # the token came after the hook saw the last chunk
            assert [n for n, _ in seen[:3]] == [16, 32, 40]
            assert seen[2][1]  # the final chunk's step sampled the first token
            async for _ in stream:
                pass
            count = len(seen)
            assert threads == {"kvmesh-engine"}
            assert not engine._hooks  # dropped with the finished stream

            def bad(e: LLMEngine, request_id: str, output: object) -> None:
                raise RuntimeError("boom")

            stream = await engine.open_stream(
                "b", lambda e: _add(e, "b", prompt, params), on_step=bad
            )
            outs = [o async for o in stream]
            assert outs[-1].finished and not engine._hooks
            assert len(seen) == count
        finally:
            await engine.shutdown()

    asyncio.run(scenario())


def test_step_observers_see_every_scheduled_token(checkpoint: Path) -> None:
    """What `kvmesh:iteration_tokens_total` observes: each step's scheduled tokens, so the sum
    is the prompt tokens computed (not cached) plus one per decode step."""
    engine = LLMEngine(EngineConfig(model=str(checkpoint), num_kv_blocks=64))
    seen: list[int] = []
    engine.step_observers.append(seen.append)
    prefix = list(range(30, 62))  # two full 16-token blocks
    finals = []
    for i, prompt in enumerate(([*prefix, 5], [*prefix, 6, 7])):
        engine.add_request(f"r{i}", prompt, PARAMS)
        while engine.has_unfinished():
            finals += [out for out in engine.step() if out.finished]
    cached = [out.num_cached_tokens for out in finals]
    assert cached == [0, 32]
    computed = sum(len(out.prompt_token_ids) for out in finals) - sum(cached)
    assert sum(seen) == computed + 2 * (PARAMS.max_tokens - 1)
    assert engine.scheduler.block_manager.metrics().prefix_hit_tokens == 32


def test_an_engine_whose_waiting_work_cannot_start_waits_instead_of_spinning(
    checkpoint: Path,
) -> None:
    """A waiting request short of blocks (they are held by a parked prefill-only request, as
    on a prefill worker while its KV ships) plans nothing until room is made: the engine
    thread waits for the command that makes it instead of running empty steps back to back,
    and the request starts once the parked one is released."""
    from kvmesh.engine import disagg

    async def scenario() -> None:
        config = EngineConfig(
            model=str(checkpoint), num_kv_blocks=8, block_size=16, num_threads=1, max_model_len=128
        )
        engine = AsyncLLMEngine(config)
        try:
            parked = disagg.build_request(
                engine.engine, "parked", list(range(1, 101)), PARAMS, prefill_only=True
            )
            stream = await engine.open_stream(
                "parked", lambda e: disagg.add_request(e, parked), cleanup=disagg.release
            )
            assert not (await anext(stream)).finished  # prefilled: 7 of the 8 blocks held
            blocked = await engine.add_request("blocked", list(range(200, 300)), PARAMS)
            await asyncio.sleep(0.2)
            state = await engine.call(lambda e: (e.scheduler.num_waiting, e.scheduler.num_running))
            assert state == (1, 0)
            calls = 0
            step = engine.engine.step

            def counted() -> list:
                nonlocal calls
                calls += 1
                return step()

            engine.engine.step = counted  # type: ignore[method-assign]
            await asyncio.sleep(1.0)
            assert calls < 400  # a stalled wait each: about 200 a second, not tens of thousands
            await stream.aclose()  # releases the parked request's blocks
            outputs = [o async for o in blocked]
            assert outputs[-1].finished and len(outputs[-1].outputs[0].token_ids) == 10
        finally:
            await engine.shutdown()

    asyncio.run(asyncio.wait_for(scenario(), timeout=120))


def test_a_reader_slower_than_the_steps_holds_few_outputs_and_misses_nothing(
    checkpoint: Path,
) -> None:
    """Outputs the reader has not read merge past a short backlog (a gRPC client or the
    control plane's flow control holding the stream back): the queue holds at most the
    backlog plus the final output, not one per step, and the reader still gets every token,
    text piece and finish once."""
    params = SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=40, ignore_eos=True)

    async def scenario() -> None:
        engine = AsyncLLMEngine(EngineConfig(model=str(checkpoint), num_kv_blocks=64))
        try:
            stream = await engine.add_request("slow", list(range(1, 200)), params)
            for _ in range(600):  # the reader reads nothing until the request ended
                if await engine.call(lambda e: not e.has_unfinished()):
                    break
                await asyncio.sleep(0.02)
            assert stream._sink.qsize() <= MERGE_BACKLOG + 1  # 40 steps made
            outputs = [o async for o in stream]
            final = outputs[-1]
            assert final.finished
            for out in final.outputs:
                pieces = [c for o in outputs for c in o.outputs if c.index == out.index]
                assert [t for c in pieces for t in c.new_token_ids] == out.token_ids
                assert "".join(c.new_text for c in pieces) == out.text
                assert sum(c.new_finish for c in pieces) == 1
        finally:
            await engine.shutdown()

    asyncio.run(asyncio.wait_for(scenario(), timeout=120))
