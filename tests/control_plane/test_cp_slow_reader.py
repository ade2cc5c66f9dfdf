"""A client that stops reading its stream over real gRPC: HTTP/2 flow control blocks the front
door's write to it, yet the run still ends by its deadline (or at an Abort, or a drain's cut)
with every holder released, and the relay buffers a bounded number of responses, holding the
worker's stream back instead of filling the control plane's memory."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import grpc
import httpx
from cp_harness import Harness, control_plane, run_async, status_of, text_request
from cp_workers import FakeWorker

from control_plane.run import RELAY_BUFFER, Run
from kvmesh.v1 import generation_pb2

TOKENS = 2000  # responses of TEXT each: 20 MB, far more than any flow-control window
TEXT = "x" * 10_000


async def flooding_pair(cp: Harness) -> FakeWorker:
    """A prefill + decode pair whose decode worker streams TOKENS responses of TEXT at once."""
    await cp.add("p0", "prefill")
    decode = await cp.add("d0", "decode")
    decode.tokens, decode.text = TOKENS, TEXT
    return decode


async def until(condition: Callable[[], bool], timeout: float) -> None:
    """Poll `condition` every 10 ms until it holds (TimeoutError after `timeout` s)."""

    async def poll() -> None:
        while not condition():
            await asyncio.sleep(0.01)

    await asyncio.wait_for(poll(), timeout)


def run_of(cp: Harness, request_id: str) -> Run | None:
    return cp.server.front_door._runs.get(request_id)


async def stuck(cp: Harness, request_id: str) -> Run:
    """The run once its relay buffer is full: the client is not reading, its write blocks."""

    def full() -> bool:
        run = run_of(cp, request_id)
        return run is not None and run.queue.qsize() >= RELAY_BUFFER

    await until(full, 10)
    run = run_of(cp, request_id)
    assert run is not None
    return run


def counted(cp: Harness, status: str) -> float | None:
    registry = cp.server.cluster.metrics.registry
    return registry.get_sample_value("kvmesh_control_requests_total", {"status": status})


def finished_everywhere(cp: Harness, decode: FakeWorker) -> bool:
    return cp.server.front_door.inflight == 0 and not decode.held


@run_async
async def test_an_unread_stream_ends_at_max_request_seconds_and_holds_the_worker_back() -> None:
    """Never read (no client deadline): at most RELAY_BUFFER responses wait in the run, the
    decode worker is held back, and at --max-request-seconds the run ends DEADLINE_EXCEEDED
    (counted once) with its entry closed and its blocks released; the client reads that."""
    async with control_plane(max_request_seconds=1.5) as cp:
        decode = await flooding_pair(cp)
        call = cp.generation.Generate(text_request(request_id="idle"))
        run = await stuck(cp, "idle")
        most = 0
        while run_of(cp, "idle") is not None:  # bounded: the run ends by its deadline
            most = max(most, run.queue.qsize())
            await asyncio.sleep(0.01)
            assert cp.server.cluster.clock() < run.deadline + 2.0, "the run outlived its deadline"
        await until(lambda: finished_everywhere(cp, decode), 2)
        assert most <= RELAY_BUFFER + 1 and decode.sent < TOKENS  # + the attempt's end marker
        assert len(cp.server.cluster.ledger) == 0
        assert cp.server.cluster.ledger.closed_outcome("idle") == "DEADLINE_EXCEEDED"
        assert counted(cp, "DEADLINE_EXCEEDED") == 1
        code, details, _ = await asyncio.wait_for(status_of(call), 10)
        assert code == grpc.StatusCode.DEADLINE_EXCEEDED and "idle" in details


@run_async
async def test_abort_ends_a_run_whose_client_stopped_reading() -> None:
    """Abort of a run blocked writing to its client answers aborted=true once the run is
    finished (blocks released), long before its deadline; the client's stream ends ABORTED."""
    async with control_plane(max_request_seconds=60) as cp:
        decode = await flooding_pair(cp)
        call = cp.generation.Generate(text_request(request_id="stalled"), timeout=60)
        await stuck(cp, "stalled")
        abort = generation_pb2.AbortRequest(request_id="stalled")
        assert (await cp.generation.Abort(abort, timeout=5)).aborted
        assert finished_everywhere(cp, decode)
        assert cp.server.cluster.ledger.closed_outcome("stalled") == "ABORTED"
        code, details, _ = await asyncio.wait_for(status_of(call), 10)
        assert code == grpc.StatusCode.ABORTED and "stalled" in details


@run_async
async def test_a_drain_cuts_a_run_whose_client_stopped_reading() -> None:
    """A drain cuts a run blocked writing to its client like any other: it ends UNAVAILABLE
    with its blocks released before the server stops."""
    async with control_plane(max_request_seconds=60) as cp:
        decode = await flooding_pair(cp)
        call = cp.generation.Generate(text_request(request_id="cut"), timeout=60)
        await stuck(cp, "cut")
        await asyncio.wait_for(cp.server.drain(grace=0.5), 10)
        assert finished_everywhere(cp, decode)
        assert cp.server.cluster.ledger.closed_outcome("cut") == "UNAVAILABLE"
        call.cancel()


@run_async
async def test_an_unread_http_stream_ends_by_max_request_seconds() -> None:
    """The HTTP door the same way: a client that sends a streamed completion and never reads
    loses its connection by --max-request-seconds, and the run ends with every holder
    released."""
    async with control_plane(max_request_seconds=1.5, http_port=0) as cp:
        decode = await flooding_pair(cp)
        assert cp.server.http is not None
        body = b'{"prompt": "hello", "stream": true, "max_tokens": 2000}'
        writer = await post_unread(cp.server.http.url, body)
        await until(lambda: cp.server.front_door.inflight == 1, 10)
        started = cp.server.cluster.clock()
        await until(lambda: finished_everywhere(cp, decode), 1.5 + 3)
        assert cp.server.cluster.clock() - started < 1.5 + 3 and decode.sent < TOKENS
        assert len(cp.server.cluster.ledger) == 0
        await until(lambda: not connections(cp), 1)  # dropped, its unsent bytes with it
        writer.close()


async def post_unread(url: str, body: bytes) -> asyncio.StreamWriter:
    """POST `body` to /v1/completions at `url` over a raw connection that never reads its
    answer; the writer, to close at the end."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    _unread, writer = await asyncio.open_connection(host, int(port))
    writer.write(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(body)}\r\n\r\n".encode()
        + body
    )
    await writer.drain()
    return writer


def connections(cp: Harness) -> list[Any]:
    """The HTTP door's open connections (uvicorn's protocol objects)."""
    assert cp.server.http is not None
    return list(cp.server.http._server.server_state.connections)


@run_async
async def test_an_unread_http_answer_loses_its_connection_by_max_request_seconds() -> None:
    """A non-streamed answer (20 MB) whose client never reads it: its writes end by
    --max-request-seconds and the connection is dropped then, instead of the whole body
    waiting in the connection's write buffer for as long as the client keeps it open. A
    client that reads gets the answer whole."""
    async with control_plane(max_request_seconds=3, http_port=0) as cp:
        worker = await cp.add("c0", "colocated")
        worker.tokens, worker.text = 100, TEXT  # 1 MB, read
        assert cp.server.http is not None
        async with httpx.AsyncClient(base_url=cp.server.http.url, timeout=10) as reading:
            read = await reading.post("/v1/completions", json={"prompt": "hi", "max_tokens": 101})
        assert read.status_code == 200
        assert len(read.json()["choices"][0]["text"]) == 1 + 100 * len(TEXT)
        worker.tokens = TOKENS  # 20 MB, never read
        writer = await post_unread(cp.server.http.url, b'{"prompt": "hello", "max_tokens": 2001}')
        started = cp.server.cluster.clock()
        await until(lambda: counted(cp, "OK") == 2, 3)  # the answer was generated in time
        await until(lambda: not connections(cp), 3 + 2)
        assert cp.server.cluster.clock() - started < 3 + 2
        writer.close()
