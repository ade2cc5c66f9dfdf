"""Fail only what failed, over real gRPC with in-test workers: a worker the run no longer
needs (a prefill worker whose transfer completed, a decode worker that refused the
reservation) ends no stream when it dies; a cancel storm at random points leaks nothing."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
from collections import Counter
from collections.abc import AsyncIterator

import grpc
from cp_harness import Harness, control_plane, run_async, status_of, text_request
from cp_workers import FakeWorker

from kvmesh.v1 import generation_pb2

FAST_LEASE = {"lease_seconds": 0.4, "heartbeat_interval_seconds": 0.1,
              "reap_interval_seconds": 0.05}  # fmt: skip
STREAMS = 4


@contextlib.asynccontextmanager
async def heartbeating(cp: Harness, *workers: FakeWorker) -> AsyncIterator[dict[str, asyncio.Task]]:  # type: ignore[type-arg]
    """Keep `workers` alive; cancel a worker's task (by id) to make it fall silent."""
    tasks = {w.worker_id: asyncio.create_task(w.keep_alive(cp.control, 0.05)) for w in workers}
    try:
        yield tasks
    finally:
        for task in tasks.values():
            task.cancel()
        await asyncio.gather(*tasks.values(), return_exceptions=True)


async def silence_and_kill(cp: Harness, worker: FakeWorker, task: asyncio.Task) -> None:  # type: ignore[type-arg]
    """The worker stops heartbeating and dies; returns once the reaper declared it dead."""
    task.cancel()
    await worker.kill()
    expiries = cp.server.cluster.metrics.worker_leases.labels(worker.role, "expired")
    for _ in range(200):
        if expiries._value.get() >= 1:
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"{worker.worker_id} was not declared dead")


async def open_streams(cp: Harness) -> list[grpc.aio.UnaryStreamCall]:  # type: ignore[type-arg]
    """STREAMS requests, each read up to its first token."""
    calls = [
        cp.generation.Generate(text_request(f"prompt {i}", request_id=f"r{i}"), timeout=10)
        for i in range(STREAMS)
    ]
    for call in calls:
        first = await asyncio.wait_for(call.read(), 5)
        assert list(first.token_ids)
    return calls


@run_async
async def test_a_finished_prefill_workers_death_ends_no_decoding_stream() -> None:
    async with control_plane(**FAST_LEASE) as cp:
        prefill = await cp.add("p0", "prefill")
        decode = await cp.add("d0", "decode")
        decode.after_first_gate = asyncio.Event()
        async with heartbeating(cp, prefill, decode) as beats:
            calls = await open_streams(cp)
            holders = [cp.server.cluster.ledger.holders(f"r{i}") for i in range(STREAMS)]
            assert {w.worker_id for held in holders for w in held} == {"d0"}
            await silence_and_kill(cp, prefill, beats["p0"])
            decode.after_first_gate.set()
            outcomes = [await status_of(call) for call in calls]
        assert [code for code, _, _ in outcomes] == [grpc.StatusCode.OK] * STREAMS
        assert all(len(responses) == 3 for _, _, responses in outcomes)  # after the first
        assert decode.held == {} and len(cp.server.cluster.ledger) == 0


@run_async
async def test_a_decode_worker_that_refused_the_reservation_is_not_a_dependency() -> None:
    async with control_plane(**FAST_LEASE) as cp:
        prefill = await cp.add("p0", "prefill")
        refusing = await cp.add("d0", "decode", num_blocks=128)  # ranked first, refuses
        refusing.reserve_error = grpc.StatusCode.RESOURCE_EXHAUSTED
        serving = await cp.add("d1", "decode")
        serving.after_first_gate = asyncio.Event()
        async with heartbeating(cp, prefill, refusing, serving) as beats:
            calls = await open_streams(cp)
            ledger = cp.server.cluster.ledger
            holders = [{w.worker_id for w in ledger.holders(f"r{i}")} for i in range(STREAMS)]
            assert holders == [{"d1"}] * STREAMS
            for _ in range(100):  # the refused reservation's Release goes out in the background
                if refusing.calls.count("Release") == STREAMS:
                    break
                await asyncio.sleep(0.01)
            assert Counter(refusing.calls) == {"Reserve": STREAMS, "Release": STREAMS}
            await silence_and_kill(cp, refusing, beats["d0"])
            serving.after_first_gate.set()
            outcomes = [await status_of(call) for call in calls]
        assert [code for code, _, _ in outcomes] == [grpc.StatusCode.OK] * STREAMS
        assert serving.held == {} and len(cp.server.cluster.ledger) == 0


@run_async
async def test_the_served_streams_end_when_their_decode_worker_dies() -> None:
    """The converse: the worker holding the stream is a dependency (UNAVAILABLE, prompt)."""
    async with control_plane(**FAST_LEASE) as cp:
        prefill = await cp.add("p0", "prefill")
        decode = await cp.add("d0", "decode")
        decode.after_first_gate = asyncio.Event()  # never set: the streams hang on d0
        async with heartbeating(cp, prefill, decode) as beats:
            calls = await open_streams(cp)
            beats["d0"].cancel()  # wedged: alive but silent
            outcomes = await asyncio.wait_for(
                asyncio.gather(*(status_of(call) for call in calls)), 3
            )
        assert [code for code, _, _ in outcomes] == [grpc.StatusCode.UNAVAILABLE] * STREAMS
        assert all("d0" in details for _, details, _ in outcomes)
        assert len(cp.server.cluster.ledger) == 0


@run_async
async def test_a_completion_the_worker_aborted_ends_the_stream_aborted() -> None:
    """A worker ending a completion with FINISH_REASON_ABORT (released there, e.g. a colocated
    worker's Release) is not a success: ABORTED naming the worker, nothing left held."""
    async with control_plane() as cp:
        await cp.add("p0", "prefill")
        decode = await cp.add("d0", "decode")
        decode.finish_reason = generation_pb2.FINISH_REASON_ABORT
        code, details, responses = await status_of(
            cp.generation.Generate(text_request(request_id="r"), timeout=5)
        )
        assert code == grpc.StatusCode.ABORTED and "d0" in details
        assert responses[-1].finish_reason == generation_pb2.FINISH_REASON_ABORT
        assert len(cp.server.cluster.ledger) == 0 and decode.held == {}


async def status_or_cancelled(
    call: grpc.aio.UnaryStreamCall,  # type: ignore[type-arg]
) -> tuple[grpc.StatusCode, str, list[generation_pb2.GenerateResponse]]:
    try:
        return await status_of(call)
    except asyncio.CancelledError:  # grpc.aio raises it in the reader of a cancelled call
        return grpc.StatusCode.CANCELLED, "", []


async def abort_once_admitted(cp: Harness, request_id: str, reader: asyncio.Task) -> None:  # type: ignore[type-arg]
    """Abort the request; NOT_FOUND means it has not reached the front door yet: try again
    while it runs."""
    request = generation_pb2.AbortRequest(request_id=request_id)
    while not reader.done():
        try:
            await cp.generation.Abort(request, timeout=5)
            return
        except grpc.aio.AioRpcError as error:
            assert error.code() == grpc.StatusCode.NOT_FOUND, error
        await asyncio.sleep(0.002)


async def one_of_the_storm(
    cp: Harness, rng: random.Random, i: int
) -> tuple[str, grpc.StatusCode, int]:
    """One request ended at a random point: completed, cancelled, aborted or timed out."""
    mode = rng.choice(["complete", "cancel", "abort", "deadline"])
    request_id = f"storm-{i}"
    timeout = rng.uniform(0.002, 0.03) if mode == "deadline" else 20
    call = cp.generation.Generate(text_request(f"p{i % 7}", request_id=request_id),
                                  timeout=timeout)  # fmt: skip
    reader = asyncio.create_task(status_or_cancelled(call))
    if mode in ("cancel", "abort"):
        await asyncio.sleep(rng.uniform(0, 0.025))
        if mode == "cancel":
            call.cancel()
        else:
            await abort_once_admitted(cp, request_id, reader)
    code, _, responses = await reader
    return mode, code, len(responses)


@run_async
async def test_a_storm_of_1000_requests_ended_at_random_points_leaks_nothing() -> None:
    async with control_plane(max_inflight=512) as cp:
        workers = [await cp.add(f"p{i}", "prefill") for i in range(2)]
        workers += [await cp.add(f"d{i}", "decode", num_blocks=4096) for i in range(2)]
        rng = random.Random(1234)
        for worker in workers:
            worker.jitter, worker.rng = 0.004, random.Random(rng.random())
        gate = asyncio.Semaphore(96)

        async def bounded(i: int) -> tuple[str, grpc.StatusCode, int]:
            async with gate:
                return await one_of_the_storm(cp, rng, i)

        async with heartbeating(cp, *workers):
            results = await asyncio.wait_for(
                asyncio.gather(*(bounded(i) for i in range(1000))), 100
            )
            for worker in workers:
                await worker.wait_empty(5.0)
        outcomes = Counter((mode, code.name) for mode, code, _ in results)
        completed = [n for mode, code, n in results if mode == "complete"]
        assert all(code == grpc.StatusCode.OK for mode, code, _ in results if mode == "complete")
        assert completed and all(n == 4 for n in completed)
        expected = {"cancel": {"CANCELLED", "OK"}, "abort": {"ABORTED", "OK"},
                    "deadline": {"DEADLINE_EXCEEDED", "OK"}, "complete": {"OK"}}  # fmt: skip
        assert all(code in expected[mode] for mode, code in outcomes), outcomes
        cut = sum(n for (mode, code), n in outcomes.items() if code != "OK")
        assert cut > 500, outcomes  # most cancels landed before the end
        assert len(cp.server.cluster.ledger) == 0 and cp.server.front_door.inflight == 0
        assert all(w.held == {} for w in workers)
        if os.environ.get("KVMESH_FAULT_REPORT"):  # see tests/system/fault_harness.py
            with open(os.environ["KVMESH_FAULT_REPORT"], "a") as out:
                line = {"case": "cancel storm (1000)", "leaked": 0, "ledger_entries": 0,
                        "outcomes": {f"{m} {c}": n for (m, c), n in outcomes.items()}}  # fmt: skip
                out.write(json.dumps(line) + "\n")
