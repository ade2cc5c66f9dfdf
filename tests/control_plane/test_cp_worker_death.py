"""Worker death over real gRPC: retry before the first token, UNAVAILABLE after it, the lease
reaper for a silent worker, and no blocks left on the survivors; a reaped worker touches neither
another worker at its address nor a run that had not called it yet."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable

import grpc
from cp_harness import Harness, collect, control_plane, run_async, status_of, text_request
from cp_workers import FakeWorker

FAST_LEASE = {"lease_seconds": 1.0, "heartbeat_interval_seconds": 0.1,
              "reap_interval_seconds": 0.05}  # fmt: skip


@contextlib.asynccontextmanager
async def heartbeating(cp: Harness, *workers: FakeWorker) -> AsyncIterator[None]:
    """Keep `workers` alive (the others fall silent: reaped when their lease lapses)."""
    tasks = [asyncio.create_task(w.keep_alive(cp.control, 0.05)) for w in workers]
    try:
        yield
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def until(condition: Callable[[], bool], seconds: float = 5.0) -> None:
    async with asyncio.timeout(seconds):
        while not condition():
            await asyncio.sleep(0.02)


@run_async
async def test_decode_death_before_first_token_retries_on_another_decode_worker() -> None:
    async with control_plane() as cp:
        prefill = await cp.add("p0", "prefill")
        doomed = await cp.add("d0", "decode", num_blocks=128)  # ranked first
        spare = await cp.add("d1", "decode")
        doomed.gate = asyncio.Event()
        call = cp.generation.Generate(text_request(request_id="r"), timeout=10)
        await asyncio.wait_for(doomed.stream_started.wait(), 5)
        await doomed.kill()
        code, _, responses = await status_of(call)
        assert code == grpc.StatusCode.OK and len(responses) == 4
        assert prefill.calls == ["PrefillAhead"] * 2  # prefill redone
        assert spare.calls[:2] == ["Reserve", "Decode"] and spare.held == {}
        assert len(cp.server.cluster.ledger) == 0
        assert cp.server.cluster.metrics.retries._value.get() == 1


@run_async
async def test_decode_death_after_a_streamed_token_is_unavailable() -> None:
    async with control_plane() as cp:
        await cp.add("p0", "prefill")
        decode = await cp.add("d0", "decode")
        await cp.add("d1", "decode")
        decode.after_first_gate = asyncio.Event()
        call = cp.generation.Generate(text_request(request_id="r"), timeout=10)
        first = await asyncio.wait_for(call.read(), 5)
        assert list(first.token_ids)
        await decode.kill()
        code, details, _ = await status_of(call)
        assert code == grpc.StatusCode.UNAVAILABLE and "d0" in details
        assert len(cp.server.cluster.ledger) == 0


@run_async
async def test_death_after_a_relayed_response_without_tokens_is_unavailable() -> None:
    """Whatever reached the client counts as streamed, tokens or not (a prompt-only answer's
    text or prompt logprobs): a retry would send it twice, so the run fails instead."""
    async with control_plane() as cp:
        await cp.add("p0", "prefill")
        decode = await cp.add("d0", "decode")
        spare = await cp.add("d1", "decode")
        decode.tokenless_first, decode.after_first_gate = True, asyncio.Event()
        call = cp.generation.Generate(text_request(request_id="r"), timeout=10)
        first = await asyncio.wait_for(call.read(), 5)
        assert first.text == "a" and not list(first.token_ids)
        await decode.kill()
        code, details, responses = await status_of(call)
        assert code == grpc.StatusCode.UNAVAILABLE and "d0" in details, (code, responses)
        assert "Decode" not in spare.calls and len(cp.server.cluster.ledger) == 0


@run_async
async def test_prefill_death_mid_transfer_releases_the_reservation_and_retries() -> None:
    async with control_plane() as cp:
        doomed = await cp.add("p0", "prefill")
        decode = await cp.add("d0", "decode")
        doomed.prefill_gate = asyncio.Event()
        call = cp.generation.Generate(text_request(request_id="r"), timeout=10)
        await asyncio.wait_for(doomed.prefill_started.wait(), 5)
        first_generation = decode.held["r"].generation
        spare = await cp.add("p1", "prefill")
        await doomed.kill()
        code, _, _ = await status_of(call)
        assert code == grpc.StatusCode.OK
        assert spare.calls == ["PrefillAhead"]
        assert ("r", first_generation) in decode.released  # the first reservation
        assert decode.held == {} and len(cp.server.cluster.ledger) == 0


@run_async
async def test_silent_decode_worker_is_reaped_and_the_request_completes_elsewhere() -> None:
    async with control_plane(lease_seconds=0.4, heartbeat_interval_seconds=0.1,
                             reap_interval_seconds=0.05) as cp:  # fmt: skip
        prefill = await cp.add("p0", "prefill")
        silent = await cp.add("d0", "decode", num_blocks=128)  # ranked first, never heartbeats
        spare = await cp.add("d1", "decode")
        silent.gate = asyncio.Event()  # hangs without dying
        alive = [asyncio.create_task(w.keep_alive(cp.control, 0.05)) for w in (prefill, spare)]
        try:
            code, _, responses = await status_of(
                cp.generation.Generate(text_request(request_id="r"), timeout=10)
            )
        finally:
            for task in alive:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        assert code == grpc.StatusCode.OK and len(responses) == 4
        assert cp.server.cluster.metrics.worker_leases.labels("decode", "expired")._value.get() == 1
        assert "r" in silent.held  # it never heard a Release: it was dead to the ledger
        # It comes back: told it is unknown, re-registers with its held set, is told to free it.
        assert not (await silent.heartbeat(cp.control)).registered
        await silent.register(cp.control)
        response = await silent.heartbeat(cp.control)
        assert list(response.release_request_ids) == ["r"] and silent.held == {}


@run_async
async def test_a_worker_back_at_a_new_address_leaves_no_channel_to_the_old_one() -> None:
    """A worker restarted under its id registers a new epoch at a new address (a new port or
    pod IP): the channel to the old address goes with the old incarnation, or a long-lived
    control plane would keep one more channel, reconnecting to a dead address, per restart."""
    async with control_plane() as cp:
        for _ in range(3):
            worker = await cp.add("c0", "colocated")
            await collect(cp.generation.Generate(text_request(), timeout=10))
        assert list(cp.server.cluster.channels._channels) == [worker.address]


@run_async
async def test_reaping_a_worker_keeps_the_channel_of_another_worker_at_its_address() -> None:
    """A worker restarted under a new id on the same port (the default id names the pid; a pod
    IP reused): when the old id's lease lapses, the channel to the address stays, and the new
    worker's stream on it goes on."""
    async with control_plane(**FAST_LEASE) as cp:
        prefill = await cp.add("p0", "prefill")
        old = await cp.add("decode-host-100", "decode")
        await old.kill()  # crashed, and restarted on its port with a new pid
        port = int(old.address.rsplit(":", 1)[1])
        new = await cp.add("decode-host-200", "decode", port=port, num_blocks=128)  # first
        assert new.address == old.address
        new.after_first_gate = asyncio.Event()
        async with heartbeating(cp, prefill, new):
            call = cp.generation.Generate(text_request(request_id="r"), timeout=10)
            assert list((await asyncio.wait_for(call.read(), 5)).token_ids)
            await until(lambda: cp.server.cluster.registry.get("decode-host-100") is None)
            new.after_first_gate.set()
            code, details, rest = await status_of(call)
        assert code == grpc.StatusCode.OK and len(rest) == 3, (code, details)
        assert "Decode" in new.calls and new.held == {}
        assert new.address in cp.server.cluster.channels._channels


@run_async
async def test_a_decode_candidate_reaped_during_an_earlier_reserve_is_not_called() -> None:
    """The decode candidates are ranked when the attempt starts; one reaped while an earlier
    one's Reserve is in flight is skipped as refused: no Reserve or Decode reaches it (nothing
    would end that run, nor release its blocks), and no channel to it is opened again."""
    async with control_plane(**FAST_LEASE) as cp:
        prefill = await cp.add("p0", "prefill")
        first = await cp.add("d0", "decode", num_blocks=128)  # ranked first; refuses, slowly
        first.reserve_error = grpc.StatusCode.RESOURCE_EXHAUSTED
        first.reserve_gate = asyncio.Event()
        silent = await cp.add("d1", "decode")  # never heartbeats; would hang in Decode
        silent.gate = asyncio.Event()
        async with heartbeating(cp, prefill, first):
            call = cp.generation.Generate(text_request(request_id="r"), timeout=5)
            await asyncio.wait_for(first.reserve_started.wait(), 5)
            await until(lambda: cp.server.cluster.registry.get("d1") is None)
            first.reserve_gate.set()
            code, details, _ = await status_of(call)
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED, (code, details)
        assert "d1: no longer registered" in details
        assert silent.calls == [] and silent.held == {}
        assert silent.address not in cp.server.cluster.channels._channels
        assert first.held == prefill.held == {} and len(cp.server.cluster.ledger) == 0


@run_async
async def test_a_tokenizer_worker_reaped_during_an_earlier_call_is_not_called() -> None:
    """/tokenize tries the serving set's prefill workers in turn; one reaped while an earlier
    one's Prepare is in flight is skipped: no call reaches it and no channel to it is opened
    again (nothing would close that channel)."""
    async with control_plane(**FAST_LEASE) as cp:
        busy = await cp.add("p0", "prefill")  # tried first; answers UNAVAILABLE, slowly
        busy.prepare_gate, busy.prepare_error = asyncio.Event(), grpc.StatusCode.UNAVAILABLE
        silent = await cp.add("p1", "prefill")  # never heartbeats
        decode = await cp.add("d0", "decode")
        async with heartbeating(cp, busy, decode):
            request = text_request(request_id="t")
            call = asyncio.create_task(cp.server.front_door.tokenize(request))
            await asyncio.wait_for(busy.prepare_started.wait(), 5)
            await until(lambda: cp.server.cluster.registry.get("p1") is None)
            busy.prepare_gate.set()
            with contextlib.suppress(Exception):
                await call
        assert busy.calls == ["Prepare"] and silent.calls == []
        assert silent.address not in cp.server.cluster.channels._channels
