"""Four thousand generated bad requests at the wire of one real front door with real in-test
workers: random bytes, mutated (truncated, flipped, spliced) valid requests, strings that are
not UTF-8, and well-formed requests with out-of-range values. Every answer is a proper status
(never UNKNOWN or INTERNAL, never a Python class name), and afterwards no worker holds a block
and the ledger is empty. `FUZZ_COUNTS` records what was sent and seen, by kind and status."""

from __future__ import annotations

import asyncio
import collections
import threading
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from cp_harness import Harness, control_plane
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvmesh.v1 import generation_pb2

BATCHES, BATCH = 40, 100  # 4,000 requests, 100 at a time
METHODS = {
    "generate": "/kvmesh.v1.GenerationService/Generate",
    "abort": "/kvmesh.v1.GenerationService/Abort",
    "model_info": "/kvmesh.v1.GenerationService/GetModelInfo",
}
NEVER = {grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL, grpc.StatusCode.DEADLINE_EXCEEDED}
FUZZ_COUNTS: collections.Counter[tuple[str, str]] = collections.Counter()

# -- strategies ---------------------------------------------------------------------------------

ints = st.one_of(st.integers(-5, 300), st.sampled_from([-(2**31), 2**31 - 1, 0, 1]))
floats = st.floats(allow_nan=True, allow_infinity=True, width=32)
texts = st.text(max_size=40)
sampling = st.builds(
    generation_pb2.SamplingParams,
    # n in 2..128 is valid but left out: the in-test workers stream a single completion
    n=st.none() | st.integers(-3, 1) | st.integers(129, 2**31 - 1),
    temperature=st.none() | floats,
    top_p=st.none() | floats,
    top_k=st.none() | ints,
    max_tokens=st.none() | ints,
    stop=st.lists(texts, max_size=70),
    stop_token_ids=st.lists(ints, max_size=5),
    logprobs=st.none() | ints,
)
prompts = st.one_of(
    st.builds(lambda t: {"text": t}, st.text(max_size=80)),
    st.builds(
        lambda ids: {"token_ids": generation_pb2.TokenIds(ids=ids)}, st.lists(ints, max_size=40)
    ),
    st.builds(
        lambda ms: {"chat": generation_pb2.ChatMessages(messages=ms)},
        st.lists(st.builds(generation_pb2.ChatMessage, role=texts, content=texts), max_size=5),
    ),
    st.just({}),
)
requests = st.builds(
    lambda prompt, params, rid, salt: generation_pb2.GenerateRequest(
        request_id=rid, sampling=params, cache_salt=salt, **prompt
    ),
    prompts,
    sampling,
    st.one_of(st.just(""), st.text(max_size=140)),
    st.binary(max_size=300),
)


@st.composite
def mutated(draw: st.DrawFn) -> bytes:
    """A valid request's bytes, truncated, with bytes flipped, or with random bytes spliced in."""
    data = bytearray(draw(requests).SerializeToString())
    how = draw(st.sampled_from(["truncate", "flip", "splice"]))
    if not data or how == "splice":
        at = draw(st.integers(0, len(data)))
        data[at:at] = draw(st.binary(min_size=1, max_size=12))
    elif how == "truncate":
        del data[draw(st.integers(0, len(data) - 1)) :]
    else:
        for _ in range(draw(st.integers(1, 4))):
            data[draw(st.integers(0, len(data) - 1))] ^= draw(st.integers(1, 255))
    return bytes(data)


@st.composite
def bad_utf8(draw: st.DrawFn) -> bytes:
    """A request whose text, chat content, request id or stop string is not UTF-8."""
    junk = draw(st.sampled_from([b"\xff", b"\xc3\x28", b"\xed\xa0\x80", b"\xf8\x88\x80\x80"]))
    raw = draw(st.binary(max_size=8)) + junk
    where = draw(st.sampled_from(["text", "request_id", "content", "stop"]))
    if where == "text":
        return b"\x12" + bytes([len(raw)]) + raw
    if where == "request_id":
        return b"\x0a" + bytes([len(raw)]) + raw + b"\x12\x01a"
    if where == "stop":
        return b"\x12\x01a\x22" + bytes([len(raw) + 2]) + b"\x5a" + bytes([len(raw)]) + raw
    message = b"\x0a\x04user\x12" + bytes([len(raw)]) + raw
    chat = b"\x0a" + bytes([len(message)]) + message
    return b"\x32" + bytes([len(chat)]) + chat


payloads = st.one_of(
    st.tuples(st.just("random bytes"), st.sampled_from(sorted(METHODS)), st.binary(max_size=64)),
    st.tuples(st.just("mutated request"), st.just("generate"), mutated()),
    st.tuples(st.just("bad UTF-8"), st.just("generate"), bad_utf8()),
    st.tuples(
        st.just("bad values"), st.just("generate"), requests.map(lambda r: r.SerializeToString())
    ),
    st.tuples(
        st.just("bad abort"),
        st.just("abort"),
        texts.map(lambda t: generation_pb2.AbortRequest(request_id=t).SerializeToString()),
    ),
)

# -- the system under test ---------------------------------------------------------------------


class Door:
    """A control plane with a prefill, a decode and a colocated in-test worker, on a loop in
    its own thread (it outlives the examples)."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self._context = control_plane(max_inflight=32)
        self._beats: list[asyncio.Task[None]] = []
        self.cp: Harness = self.run(self._start(), 30)

    async def _start(self) -> Harness:
        cp = await self._context.__aenter__()
        for worker in (await cp.add("p0", "prefill"), await cp.add("d0", "decode")):
            self._beats.append(asyncio.create_task(worker.keep_alive(cp.control, 0.5)))
        return cp

    def run(self, coro: Any, timeout: float = 60.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    async def send(self, kind: str, method: str, payload: bytes) -> tuple[str, grpc.StatusCode]:
        channel = self.cp.channel
        try:
            if method == "generate":
                async for _ in channel.unary_stream(METHODS[method])(payload, timeout=20):
                    pass
            else:
                await channel.unary_unary(METHODS[method])(payload, timeout=20)
        except grpc.aio.AioRpcError as error:
            details = error.details() or ""
            assert "<class" not in details and "Traceback" not in details, details
            return kind, error.code()
        return kind, grpc.StatusCode.OK

    async def batch(self, items: list[tuple[str, str, bytes]]) -> list[tuple[str, Any]]:
        return list(await asyncio.gather(*(self.send(*item) for item in items)))

    async def quiet(self) -> None:
        for worker in self.cp.workers:
            await worker.wait_empty(timeout=5.0)
        assert await self.cp.server.front_door.wait_idle(5.0)

    async def _stop_beats(self) -> None:
        for beat in self._beats:
            beat.cancel()
        await asyncio.gather(*self._beats, return_exceptions=True)

    def close(self) -> None:
        self.run(self._stop_beats(), 10)
        self.run(self._context.__aexit__(None, None, None), 30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture(scope="module")
def door() -> Iterator[Door]:
    started = Door()
    yield started
    started.close()


@pytest.mark.timeout(240)  # about 10 s of CPU; more wall time on a busy machine
def test_four_thousand_bad_requests_get_proper_statuses_and_leak_nothing(door: Door) -> None:
    @settings(
        max_examples=BATCHES,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(st.lists(payloads, min_size=BATCH, max_size=BATCH))
    def one_batch(items: list[tuple[str, str, bytes]]) -> None:
        for kind, code in door.run(door.batch(items)):
            assert code not in NEVER, (kind, code)
            FUZZ_COUNTS[(kind, code.name)] += 1

    one_batch()
    assert sum(FUZZ_COUNTS.values()) >= BATCHES * BATCH
    door.run(door.quiet())
    cp = door.cp
    assert all(worker.held == {} for worker in cp.workers)
    assert len(cp.server.cluster.ledger) == 0 and cp.server.front_door.inflight == 0
    ok = door.run(door.send("valid", "generate", b"\x12\x02hi"))
    assert ok == ("valid", grpc.StatusCode.OK)  # and the door still serves
    for (kind, code), count in sorted(FUZZ_COUNTS.items()):
        print(f"{kind:16} {code:20} {count}")
