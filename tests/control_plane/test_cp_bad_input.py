"""Bad input at the wire of a real front door with real in-test workers: undecodable messages,
invalid UTF-8, size bounds, BadRequest details; nothing is started and nothing is held."""

from __future__ import annotations

import time

import grpc
import pytest
from cp_harness import (
    TEST_TOKEN,
    Harness,
    collect,
    control_plane,
    run_async,
    status_of,
    text_request,
)
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from control_plane.limits import RequestLimits
from control_plane.run import UP_TO_CONTEXT_ESTIMATE, Run
from kvmesh.security import Security
from kvmesh.v1 import generation_pb2, worker_pb2

GENERATE = "/kvmesh.v1.GenerationService/Generate"
ABORT = "/kvmesh.v1.GenerationService/Abort"
REGISTER = "/kvmesh.v1.ControlService/Register"
API_KEY = "bad-input-test-api-key-0123"
SMALL = RequestLimits(max_prompt_bytes=1000, max_messages=3, max_n=4, max_stop_strings=2)


async def pair(cp: Harness) -> tuple:  # type: ignore[type-arg]
    return await cp.add("p0", "prefill"), await cp.add("d0", "decode")


def violations(error: grpc.aio.AioRpcError) -> list[str]:
    """The fields a failed call's BadRequest detail names."""
    status = rpc_status.from_call(error)  # type: ignore[arg-type]
    assert status is not None, "no google.rpc.Status details"
    fields = []
    for detail in status.details:
        if detail.Is(error_details_pb2.BadRequest.DESCRIPTOR):
            bad = error_details_pb2.BadRequest()
            detail.Unpack(bad)
            fields += [v.field for v in bad.field_violations]
    return fields


def violations_or_none(error: grpc.aio.AioRpcError) -> list[str] | None:
    """The BadRequest fields of a failed call, None when it carries no status details."""
    return None if rpc_status.from_call(error) is None else violations(error)  # type: ignore[arg-type]


async def raw_stream(
    cp: Harness,
    payload: bytes,
    method: str = GENERATE,
    metadata: tuple[tuple[str, str], ...] = (),
) -> grpc.aio.AioRpcError:
    call = cp.channel.unary_stream(method)(payload, timeout=5, metadata=metadata)
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        async for _ in call:
            pass
    return caught.value


def assert_nothing_started(cp: Harness) -> None:
    for worker in cp.workers:
        assert worker.calls == [] and worker.held == {}
    assert len(cp.server.cluster.ledger) == 0
    assert cp.server.front_door.inflight == 0


@run_async
async def test_undecodable_request_is_invalid_argument_with_a_plain_message() -> None:
    async with control_plane() as cp:
        await pair(cp)
        error = await raw_stream(cp, b"\xff\xff garbage")
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert error.details() == (
            "request: not a valid kvmesh.v1.GenerateRequest (the wire format is corrupt)"
        )
        assert violations(error) == ["request"]
        abort = cp.channel.unary_unary(ABORT)
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await abort(b"\x0a\xff", timeout=5)  # a length running past the end
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        with pytest.raises(grpc.aio.AioRpcError) as caught:  # the internal door, with the token
            await cp.internal.unary_unary(REGISTER)(b"\x0f", timeout=5)
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "class" not in (caught.value.details() or "")
        assert_nothing_started(cp)
        assert len(cp.server.cluster.registry) == 2


@run_async
async def test_unauthenticated_bytes_are_refused_before_they_are_parsed() -> None:
    """Without the cluster token an undecodable Register is UNAUTHENTICATED, not
    INVALID_ARGUMENT: the token check runs before the decode check."""
    async with control_plane() as cp:
        await pair(cp)
        anonymous = grpc.aio.insecure_channel(cp.server.internal_address)
        try:
            for payload in (b"\x0f", b"\xff\xff garbage"):
                with pytest.raises(grpc.aio.AioRpcError) as caught:
                    await anonymous.unary_unary(REGISTER)(payload, timeout=5)
                assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
                assert violations_or_none(caught.value) is None
        finally:
            await anonymous.close(None)
        assert cp.server.internal_auth[0].refused == 2
        assert len(cp.server.cluster.registry) == 2
        assert_nothing_started(cp)


@run_async
async def test_public_door_checks_the_api_key_before_the_bytes() -> None:
    """With API keys an undecodable Generate is UNAUTHENTICATED without a key and
    INVALID_ARGUMENT naming `request` with one."""
    keyed = Security(token=TEST_TOKEN, api_keys=(API_KEY,))
    async with control_plane(security=keyed) as cp:
        await pair(cp)
        error = await raw_stream(cp, b"\xff\xff garbage")
        assert error.code() == grpc.StatusCode.UNAUTHENTICATED
        assert violations_or_none(error) is None
        with_key = (("authorization", f"Bearer {API_KEY}"),)
        error = await raw_stream(cp, b"\xff\xff garbage", metadata=with_key)
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert violations(error) == ["request"]
        assert cp.server.public_auth[0].refused == 1
        assert_nothing_started(cp)


@pytest.mark.parametrize(
    ("request_bytes", "field"),
    [
        (b"\x12\x03a\xff\xfe", "prompt.text"),
        (
            generation_pb2.GenerateRequest(
                chat=generation_pb2.ChatMessages(
                    messages=[generation_pb2.ChatMessage(role="user", content="ok")] * 2
                )
            ).SerializeToString()[:-2]
            + b"\xc3\x28",  # the second message's content "ok" -> an invalid 2-byte sequence
            "prompt.chat.messages[1].content",
        ),
        (b"\x12\x01a" + b"\x22\x04\x5a\x02\xed\xa0", "sampling.stop[0]"),  # a UTF-16 surrogate
    ],
)
def test_invalid_utf8_is_invalid_argument_naming_the_field(
    request_bytes: bytes, field: str
) -> None:
    async def scenario() -> None:
        async with control_plane() as cp:
            await pair(cp)
            error = await raw_stream(cp, request_bytes)
            assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert error.details() == f"{field}: not valid UTF-8"
            assert violations(error) == [field]
            assert_nothing_started(cp)

    run_async(scenario)()


def chat(
    count: int, content: str = "hi", role: str = "user", name: str = "", **options: str
) -> generation_pb2.ChatMessages:
    message = generation_pb2.ChatMessage(role=role, content=content, name=name)
    return generation_pb2.ChatMessages(messages=[message] * count, **options)


@pytest.mark.parametrize(
    ("request_kwargs", "field"),
    [
        ({"text": "x" * 1001}, "prompt.text"),
        ({"text": "é" * 501}, "prompt.text"),  # 501 characters, 1002 bytes
        ({"token_ids": generation_pb2.TokenIds(ids=[1] * (1 << 20 | 1))}, "prompt.token_ids.ids"),
        ({"chat": chat(4)}, "prompt.chat.messages"),
        ({"chat": chat(3, "y" * 400)}, "prompt.chat.messages[2].content"),
        ({"chat": chat(1, role="r" * 65)}, "prompt.chat.messages[0].role"),
        ({"chat": chat(1, name="n" * 65)}, "prompt.chat.messages[0].name"),
        ({"chat": chat(1, template_kwargs="{}" + " " * 65535)}, "prompt.chat.template_kwargs"),
        ({"chat": chat(1, template_kwargs='{"x": "' + "é" * 32766 + '"}')},
         "prompt.chat.template_kwargs"),  # 32774 characters, 65542 bytes
        ({"chat": chat(1, documents="[" + " " * 1000 + "]")}, "prompt.chat.documents"),
        ({"chat": chat(3, "y" * 200, documents="[" + " " * 598 + "]")},
         "prompt.chat.messages[2].content"),  # counted with the contents
        ({"text": "x", "sampling": generation_pb2.SamplingParams(n=5)}, "sampling.n"),
        ({"text": "x", "sampling": generation_pb2.SamplingParams(max_tokens=-2)},
         "sampling.max_tokens"),  # -1 is no bound but the context
        ({"text": "x", "sampling": generation_pb2.SamplingParams(max_tokens=0)},
         "sampling.max_tokens"),
        ({"text": "x", "sampling": generation_pb2.SamplingParams(stop=["a", "b", "c"])},
         "sampling.stop"),
        ({"text": "x", "sampling": generation_pb2.SamplingParams(stop=["s" * 1025])},
         "sampling.stop[0]"),
        ({"text": "x", "sampling": generation_pb2.SamplingParams(stop_token_ids=[1] * 1025)},
         "sampling.stop_token_ids"),
        ({"text": "x", "sampling": generation_pb2.SamplingParams(
            logit_bias={i: 1.0 for i in range(1025)})}, "sampling.logit_bias"),
        ({"text": "x", "cache_salt": b"s" * 257}, "cache_salt"),
    ],
)  # fmt: skip
def test_size_bounds_are_invalid_argument_with_bad_request_details(
    request_kwargs: dict[str, object], field: str
) -> None:
    async def scenario() -> None:
        async with control_plane(limits=SMALL) as cp:
            await pair(cp)
            request = generation_pb2.GenerateRequest(**request_kwargs)  # type: ignore[arg-type]
            call = cp.generation.Generate(request, timeout=5)
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await call.read()
            error = caught.value
            assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert (error.details() or "").startswith(f"{field}: ")
            assert violations(error) == [field]
            assert_nothing_started(cp)

    run_async(scenario)()


@run_async
async def test_max_tokens_minus_one_is_bounded_by_the_context_alone() -> None:
    """max_tokens -1 (no bound but the model's context) is admitted; the front door, not
    knowing the prompt's room, estimates the run at UP_TO_CONTEXT_ESTIMATE tokens."""
    async with control_plane(limits=SMALL) as cp:
        await pair(cp)
        sampling = generation_pb2.SamplingParams(max_tokens=-1)
        responses = await collect(cp.generation.Generate(text_request(sampling=sampling)))
        assert responses[-1].finish_reason == generation_pb2.FINISH_REASON_LENGTH
    run = Run("r", generation_pb2.GenerateRequest(sampling=sampling), 0.0, 1.0)
    assert run.max_tokens() == UP_TO_CONTEXT_ESTIMATE


@run_async
async def test_message_over_the_door_limit_is_refused_at_once() -> None:
    async with control_plane(max_message_bytes=1 << 20) as cp:
        prefill, _ = await pair(cp)
        started = time.monotonic()
        call = cp.generation.Generate(text_request("x" * (2 << 20)), timeout=5)
        code, details, _ = await status_of(call)
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED, details
        assert time.monotonic() - started < 2.0
        assert_nothing_started(cp)
        code, _, _ = await status_of(cp.generation.Generate(text_request("ok"), timeout=5))
        assert code == grpc.StatusCode.OK  # the door still serves
        assert prefill.calls == ["PrefillAhead"]  # no Prepare: the prefill worker prepares it


@run_async
async def test_register_with_bad_utf8_in_the_worker_id_is_refused() -> None:
    async with control_plane() as cp:
        info = worker_pb2.WorkerInfo(worker_id="w").SerializeToString().replace(b"w", b"\xff")
        request = b"\x0a" + bytes([len(info)]) + info
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await cp.internal.unary_unary(REGISTER)(request, timeout=5)
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert caught.value.details() == "worker.worker_id: not valid UTF-8"
        assert len(cp.server.cluster.registry.alive_by_role()["prefill"]) == 0
