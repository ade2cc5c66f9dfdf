"""The front door over real gRPC with real in-test worker peers: success paths, bad input,
cancel, deadline, Abort, admission and overload. Worker death is in test_cp_worker_death.py."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from cp_harness import Harness, control_plane, run_async, status_of, text_request

from kvmesh.v1 import generation_pb2

LENGTH = generation_pb2.FINISH_REASON_LENGTH


async def pair(cp: Harness) -> tuple:  # type: ignore[type-arg]
    return await cp.add("p0", "prefill"), await cp.add("d0", "decode")


def assert_ledger_empty(cp: Harness) -> None:
    assert len(cp.server.cluster.ledger) == 0
    assert cp.server.front_door.inflight == 0


@run_async
async def test_no_workers_is_unavailable_with_a_clear_message() -> None:
    async with control_plane() as cp:
        code, details, _ = await status_of(cp.generation.Generate(text_request(), timeout=5))
        assert code == grpc.StatusCode.UNAVAILABLE
        assert "prefill" in details and "colocated" in details


@run_async
async def test_disaggregated_request_streams_tokens_usage_and_releases_everything() -> None:
    async with control_plane() as cp:
        prefill, decode = await pair(cp)
        request = text_request("hi", request_id="req-1")
        code, _, responses = await status_of(cp.generation.Generate(request, timeout=5))
        assert code == grpc.StatusCode.OK
        assert [r.request_id for r in responses] == ["req-1"] * 4
        assert [list(r.token_ids) for r in responses] == [[ord("i")], [0], [1], [2]]
        last = responses[-1]
        assert last.finish_reason == LENGTH
        usage = last.usage
        assert (usage.prompt_tokens, usage.completion_tokens) == (2, 4)
        assert 0 < usage.ttft_seconds <= usage.e2e_seconds
        breakdown = usage.ttft_breakdown
        assert breakdown.prefill_seconds == pytest.approx(0.002)
        assert breakdown.transfer_seconds == pytest.approx(0.003)
        assert breakdown.first_decode_seconds == pytest.approx(0.01)
        assert breakdown.queue_seconds >= 0.001
        assert prefill.calls == ["PrefillAhead"]  # no Prepare: the prefill worker prepares it
        assert decode.calls[:2] == ["Reserve", "Decode"]
        assert decode.held == {} and prefill.held == {}
        assert_ledger_empty(cp)
        assert (
            await cp.generation.Abort(generation_pb2.AbortRequest(request_id="req-1"))
        ).aborted is False
        registry = cp.server.cluster.metrics.registry
        phase_sums = {
            phase: registry.get_sample_value(
                "kvmesh_control_ttft_phase_seconds_sum", {"phase": phase}
            )
            for phase in ("prefill", "transfer", "first_decode")
        }
        assert phase_sums == pytest.approx(
            {"prefill": 0.002, "transfer": 0.003, "first_decode": 0.01}
        )
        info = await cp.generation.GetModelInfo(generation_pb2.GetModelInfoRequest(), timeout=5)
        assert info.mode == "disaggregated"


@run_async
async def test_colocated_worker_serves_whole_requests_when_no_pair_exists() -> None:
    async with control_plane() as cp:
        worker = await cp.add("c0", "colocated")
        code, _, responses = await status_of(cp.generation.Generate(text_request("ab"), timeout=5))
        assert code == grpc.StatusCode.OK
        assert responses[0].token_ids == [ord("b")]
        usage = responses[-1].usage
        assert usage.ttft_breakdown.prefill_seconds == pytest.approx(0.005)
        assert responses[0].request_id.startswith("req-")  # assigned by the server
        assert worker.calls == ["Generate", "Release"] and worker.held == {}
        info = await cp.generation.GetModelInfo(generation_pb2.GetModelInfoRequest(), timeout=5)
        assert (info.mode, info.vocab_size) == ("colocated", 256)
        assert_ledger_empty(cp)


@run_async
async def test_model_info_follows_the_usable_worker_set() -> None:
    """A lone prefill or decode worker serves nothing: UNAVAILABLE, as Generate says (it used to
    answer mode "colocated" with no colocated worker); the pair makes it "disaggregated"."""
    async with control_plane() as cp:
        info = generation_pb2.GetModelInfoRequest()
        for role in ("prefill", "decode"):
            await cp.add(f"{role[0]}0", role, block_size=16 if role == "prefill" else 32)
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await cp.generation.GetModelInfo(info, timeout=5)
            assert caught.value.code() == grpc.StatusCode.UNAVAILABLE  # layouts differ
        await cp.add("d1", "decode")
        assert (await cp.generation.GetModelInfo(info, timeout=5)).mode == "disaggregated"


@run_async
async def test_colocated_workers_share_the_load_by_prefix() -> None:
    """Several colocated workers: distinct prefixes spread over all of them (every request
    used to go to the first worker registered while the others idled)."""
    async with control_plane() as cp:
        workers = [await cp.add(f"c{i}", "colocated") for i in range(3)]
        prompts = [f"{i:02d} " * 12 for i in range(24)]
        for text in [*prompts, prompts[5], prompts[5]]:
            code, _, _ = await status_of(cp.generation.Generate(text_request(text), timeout=5))
            assert code == grpc.StatusCode.OK
        served = [worker.calls.count("Generate") for worker in workers]
        assert sum(served) == 26 and min(served) > 0, served
        assert_ledger_empty(cp)


CHAT_NO_ROLE = generation_pb2.ChatMessages(
    messages=[generation_pb2.ChatMessage(role="user", content="a"), generation_pb2.ChatMessage()]
)


@pytest.mark.parametrize(
    ("request_kwargs", "field"),
    [
        ({}, "prompt"),
        ({"text": ""}, "text"),
        ({"token_ids": generation_pb2.TokenIds(ids=[])}, "token_ids"),
        ({"chat": generation_pb2.ChatMessages()}, "prompt.chat.messages"),
        ({"chat": CHAT_NO_ROLE}, "prompt.chat.messages[1].role"),
        ({"text": "x", "request_id": "bad\nid"}, "request_id"),
        ({"text": "x", "request_id": "r" * 129}, "request_id"),
        ({"text": "x", "request_id": "a#1"}, "request_id"),  # could name another's completion
        ({"text": "x", "sampling": generation_pb2.SamplingParams(max_tokens=0)}, "max_tokens"),
        ({"text": "x", "cache_salt": b"s" * 257}, "cache_salt"),
    ],
)
def test_structural_errors_are_invalid_argument_naming_the_field(
    request_kwargs: dict[str, object], field: str
) -> None:
    async def scenario() -> None:
        async with control_plane() as cp:
            prefill, _ = await pair(cp)
            request = generation_pb2.GenerateRequest(**request_kwargs)  # type: ignore[arg-type]
            code, details, _ = await status_of(cp.generation.Generate(request, timeout=5))
            assert code == grpc.StatusCode.INVALID_ARGUMENT
            assert field in details
            assert prefill.calls == []  # nothing was started

    asyncio.run(scenario())


@run_async
async def test_prepare_invalid_argument_passes_through_unchanged() -> None:
    async with control_plane() as cp:
        await pair(cp)
        request = generation_pb2.GenerateRequest(token_ids=generation_pb2.TokenIds(ids=[1, 999]))
        code, details, _ = await status_of(cp.generation.Generate(request, timeout=5))
        assert code == grpc.StatusCode.INVALID_ARGUMENT
        assert details == "token_ids.ids[1] = 999 is outside [0, 256)"
        assert_ledger_empty(cp)


@run_async
async def test_abort_unknown_is_not_found_and_empty_is_invalid() -> None:
    async with control_plane() as cp:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await cp.generation.Abort(generation_pb2.AbortRequest(request_id="nope"), timeout=5)
        assert caught.value.code() == grpc.StatusCode.NOT_FOUND
        assert "nope" in (caught.value.details() or "")
        for bad in ("", "a#1"):
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await cp.generation.Abort(generation_pb2.AbortRequest(request_id=bad), timeout=5)
            assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "request_id" in (caught.value.details() or "")


async def started_blocked_request(cp: Harness, request_id: str) -> tuple:  # type: ignore[type-arg]
    """A request whose decode stream waits on the decode worker's gate."""
    prefill, decode = await pair(cp)
    decode.gate = asyncio.Event()
    call = cp.generation.Generate(text_request(request_id=request_id), timeout=10)
    await asyncio.wait_for(decode.stream_started.wait(), 5)
    assert decode.held and cp.server.cluster.ledger.is_live(request_id)
    return call, prefill, decode


@run_async
async def test_client_cancel_releases_every_holder_within_a_second() -> None:
    async with control_plane() as cp:
        call, _, decode = await started_blocked_request(cp, "c1")
        call.cancel()
        await decode.wait_empty(timeout=1.0)
        assert decode.released == [("c1", decode.released[0][1])]
        await asyncio.wait_for(cp.server.front_door.wait_idle(1.0), 2)
        assert_ledger_empty(cp)
        assert cp.server.cluster.ledger.closed_outcome("c1") == "CANCELLED"


@run_async
async def test_deadline_expiry_ends_with_deadline_exceeded_and_releases() -> None:
    async with control_plane() as cp:
        _, decode = await pair(cp)
        decode.gate = asyncio.Event()
        call = cp.generation.Generate(text_request(request_id="d1"), timeout=0.5)
        code, _, _ = await status_of(call)
        assert code == grpc.StatusCode.DEADLINE_EXCEEDED
        await decode.wait_empty(timeout=1.0)
        await cp.server.front_door.wait_idle(1.0)
        assert_ledger_empty(cp)


@run_async
async def test_abort_ends_the_stream_with_aborted_and_is_idempotent() -> None:
    async with control_plane() as cp:
        call, _, decode = await started_blocked_request(cp, "a1")
        abort = generation_pb2.AbortRequest(request_id="a1")
        assert (await cp.generation.Abort(abort, timeout=5)).aborted
        code, details, _ = await status_of(call)
        assert code == grpc.StatusCode.ABORTED and "a1" in details
        assert decode.held == {}
        assert_ledger_empty(cp)
        assert not (await cp.generation.Abort(abort, timeout=5)).aborted


@run_async
async def test_duplicate_running_id_is_already_exists() -> None:
    async with control_plane() as cp:
        call, _, decode = await started_blocked_request(cp, "dup")
        code, details, _ = await status_of(cp.generation.Generate(text_request(request_id="dup")))
        assert code == grpc.StatusCode.ALREADY_EXISTS and "dup" in details
        decode.gate.set()  # type: ignore[union-attr]
        assert (await status_of(call))[0] == grpc.StatusCode.OK


@run_async
async def test_admission_limit_answers_resource_exhausted_with_retry_hint() -> None:
    async with control_plane(max_inflight=1, retry_after_ms=250) as cp:
        call, _, decode = await started_blocked_request(cp, "first")
        second = cp.generation.Generate(text_request(request_id="second"), timeout=5)
        code, details, _ = await status_of(second)
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "in flight" in details
        assert ("retry-after-ms", "250") in list(await second.trailing_metadata())
        decode.gate.set()  # type: ignore[union-attr]
        assert (await status_of(call))[0] == grpc.StatusCode.OK


@run_async
async def test_exhausted_decode_worker_is_skipped_then_all_exhausted_is_reported() -> None:
    async with control_plane(retry_after_ms=300) as cp:
        await cp.add("p0", "prefill")
        full = await cp.add("d0", "decode", num_blocks=128)  # ranked first: most free blocks
        spare = await cp.add("d1", "decode")
        full.reserve_error = grpc.StatusCode.RESOURCE_EXHAUSTED
        code, _, _ = await status_of(cp.generation.Generate(text_request(), timeout=5))
        assert code == grpc.StatusCode.OK
        assert full.calls == ["Reserve", "Release"] and spare.calls[:2] == ["Reserve", "Decode"]
        spare.reserve_error = grpc.StatusCode.RESOURCE_EXHAUSTED
        call = cp.generation.Generate(text_request(), timeout=5)
        code, details, _ = await status_of(call)
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "free KV blocks" in details
        assert ("retry-after-ms", "300") in list(await call.trailing_metadata())
        assert_ledger_empty(cp)


@run_async
async def test_layout_mismatch_is_failed_precondition_naming_the_layout() -> None:
    async with control_plane() as cp:
        await cp.add("p0", "prefill", block_size=16)
        await cp.add("d0", "decode", block_size=32)
        code, details, _ = await status_of(cp.generation.Generate(text_request(), timeout=5))
        assert code == grpc.StatusCode.FAILED_PRECONDITION and "layout" in details


@run_async
async def test_token_ids_route_without_prepare_and_decode_opens_with_prefill() -> None:
    """No call before Reserve (token ids are routed as they are); Decode is opened while
    Prefill still runs and waits for the KV; the ledger keeps its order (PREFILLING until
    Prefill returned), and the first token comes from the decode side."""
    async with control_plane() as cp:
        prefill = await cp.add("p0", "prefill")
        decode = await cp.add("d0", "decode")
        prefill.prefill_gate = asyncio.Event()
        ids = generation_pb2.TokenIds(ids=[7, 8, 9])
        request = generation_pb2.GenerateRequest(request_id="early", token_ids=ids)
        call = cp.generation.Generate(request, timeout=10)
        await asyncio.wait_for(prefill.prefill_started.wait(), 5)
        for _ in range(200):
            if "Decode" in decode.calls:
                break
            await asyncio.sleep(0.01)
        assert decode.calls == ["Reserve", "Decode"]  # opened while Prefill is held
        assert cp.server.cluster.ledger.get("early").state.value == "PREFILLING"
        prefill.prefill_gate.set()
        code, _, responses = await status_of(call)
        assert code == grpc.StatusCode.OK
        assert list(responses[0].token_ids) == [9]  # the decode side's first token
        assert prefill.calls == ["PrefillAhead"]
        assert len(cp.server.cluster.ledger) == 0
