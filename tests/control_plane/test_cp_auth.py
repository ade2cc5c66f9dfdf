"""The control plane's doors over real gRPC and HTTP: the public door serves only the client API,
the internal door only ControlService; forged Register/Heartbeat calls (no token, a wrong one,
a malformed header) are refused UNAUTHENTICATED and change nothing; the control plane presents
the token on its calls to workers; API keys guard the public gRPC and HTTP doors."""

from __future__ import annotations

import asyncio
import json
import urllib.request
from dataclasses import replace
from typing import Any

import grpc
import httpx
import openai
import pytest
from cp_harness import Harness, control_plane, run_async, status_of, text_request
from cp_workers import FakeWorker
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvmesh.client import AsyncClient, KvmeshError
from kvmesh.security import Security
from kvmesh.v1 import generation_pb2, generation_pb2_grpc, worker_pb2, worker_pb2_grpc

TOKEN = "cp-auth-cluster-token-0123456789"
KEYS = ("api-key-one-0123456789", "api-key-two-0123456789")
SECURED = Security(token=TOKEN, api_keys=KEYS)
WORKER = Security(token=TOKEN)  # fake workers require the token, as real ones do
UNAUTHENTICATED = grpc.StatusCode.UNAUTHENTICATED
# Metadata a forger might send: nothing, a wrong token, the token without "Bearer ", the token
# under another header, a wrong token with the right prefix of the real one.
FORGED: list[tuple[tuple[str, str], ...]] = [
    (),
    (("authorization", "Bearer not-the-cluster-token-at-all"),),
    (("authorization", TOKEN),),
    (("x-kvmesh-token", TOKEN),),
    (("authorization", f"Bearer {TOKEN[:-1]}"),),
]
SERVING = health_pb2.HealthCheckResponse.SERVING


async def code_of(call: Any) -> grpc.StatusCode:
    try:
        response = await call
        if hasattr(response, "__aiter__"):
            [_ async for _ in response]
    except grpc.aio.AioRpcError as error:
        if error.code() == UNAUTHENTICATED:
            assert "token" in (error.details() or "") or "API key" in (error.details() or "")
        return error.code()
    return grpc.StatusCode.OK


@run_async
async def test_public_door_has_no_control_rpcs_and_internal_door_no_client_api() -> None:
    async with control_plane() as cp:
        public = grpc.aio.insecure_channel(cp.server.address)
        internal = grpc.aio.insecure_channel(cp.server.internal_address)
        info = FakeWorker("p0", "prefill").info()
        register = worker_pb2_grpc.ControlServiceStub(public).Register
        assert await code_of(register(worker_pb2.RegisterRequest(worker=info), timeout=5)) == (
            grpc.StatusCode.UNIMPLEMENTED
        )
        generate = generation_pb2_grpc.GenerationServiceStub(internal).GetModelInfo
        assert await code_of(generate(generation_pb2.GetModelInfoRequest(), timeout=5)) == (
            grpc.StatusCode.UNIMPLEMENTED
        )
        assert len(cp.server.cluster.registry) == 0
        for channel in (public, internal):
            check = health_pb2_grpc.HealthStub(channel).Check
            assert (await check(health_pb2.HealthCheckRequest(), timeout=5)).status == SERVING
            await channel.close(None)


async def forged_calls(cp: Harness, victim: FakeWorker) -> int:
    """Every forged Register/Heartbeat against the internal door; returns how many were sent."""
    channel = grpc.aio.insecure_channel(cp.server.internal_address)
    stub = worker_pb2_grpc.ControlServiceStub(channel)
    takeover = victim.info(epoch=victim.epoch + 1000, address="127.0.0.1:9")
    fake = FakeWorker("evil-prefill", "prefill").info(address="127.0.0.1:9")
    calls = [
        lambda md: stub.Register(worker_pb2.RegisterRequest(worker=takeover), metadata=md),
        lambda md: stub.Register(worker_pb2.RegisterRequest(worker=fake), metadata=md),
        lambda md: stub.Heartbeat(
            worker_pb2.HeartbeatRequest(worker_id=victim.worker_id, epoch=victim.epoch),
            metadata=md,
        ),
    ]
    sent = 0
    for metadata in FORGED:
        for call in calls:
            assert await code_of(call(metadata)) == UNAUTHENTICATED, metadata
            sent += 1
    check = health_pb2_grpc.HealthStub(channel).Check  # health stays open for probes
    assert (await check(health_pb2.HealthCheckRequest(), timeout=5)).status == SERVING
    await channel.close(None)
    return sent


@run_async
async def test_forged_register_and_heartbeat_are_refused_and_change_nothing() -> None:
    async with control_plane(security=SECURED) as cp:
        prefill = await cp.add("p0", "prefill", security=WORKER)
        decode = await cp.add("d0", "decode", security=WORKER)
        registry = cp.server.cluster.registry
        before = {r.worker_id: (r.epoch, r.address) for r in registry.alive()}
        sent = await forged_calls(cp, decode)
        assert sent == 15 and cp.server.internal_auth[0].refused == sent  # type: ignore[attr-defined]
        counter = cp.server.cluster.metrics.registry.get_sample_value
        assert counter("kvmesh_control_auth_refused_total", {"door": "internal"}) == sent
        after = {r.worker_id: (r.epoch, r.address) for r in registry.alive()}
        assert after == before and set(after) == {"p0", "d0"}
        # The genuine workers still serve, and the control plane presented the token to them.
        call = cp.generation.Generate(
            text_request(), metadata=[("authorization", f"Bearer {KEYS[0]}")]
        )
        tokens = [t async for r in call for t in r.token_ids]
        assert tokens
        seen = prefill.metadata + decode.metadata
        assert seen and all(m.get("authorization") == f"Bearer {TOKEN}" for m in seen)


@run_async
async def test_api_keys_guard_the_public_grpc_door_and_health_stays_open() -> None:
    async with control_plane(security=SECURED) as cp:
        await cp.add("p0", "prefill"), await cp.add("d0", "decode")
        for key in (None, "wrong-key-0123456789abc", KEYS[0][:-1]):
            async with AsyncClient(cp.server.address, timeout=5, api_key=key) as client:
                with pytest.raises(KvmeshError) as caught:
                    await client.model_info()
                assert caught.value.code == UNAUTHENTICATED
                assert "API key" in caught.value.message
                with pytest.raises(KvmeshError) as caught:
                    await client.complete("hello", max_tokens=2)
                assert caught.value.code == UNAUTHENTICATED
                assert await client.serving()
        assert len(cp.server.cluster.ledger) == 0 and not cp.workers[0].calls
        for key in KEYS:
            async with AsyncClient(cp.server.address, timeout=5, api_key=key) as client:
                assert (await client.model_info()).model_name == "tiny"
                assert (await client.complete("hello", max_tokens=2)).token_ids
        per_call = [("authorization", f"Bearer {KEYS[1]}")]
        async with AsyncClient(cp.server.address, timeout=5) as client:
            assert (await client.model_info(metadata=per_call)).model_name == "tiny"


@run_async
async def test_only_the_api_key_that_started_a_request_can_abort_it() -> None:
    """Each API key is a tenant: another key's Abort of a running request is NOT_FOUND (as for
    an id never seen) and the stream goes on; its own key's Abort ends it ABORTED."""
    async with control_plane(security=SECURED) as cp:
        await cp.add("p0", "prefill")
        decode = await cp.add("d0", "decode")
        decode.gate = asyncio.Event()
        owner, other = ([("authorization", f"Bearer {key}")] for key in KEYS)
        call = cp.generation.Generate(text_request(request_id="mine"), timeout=10, metadata=owner)
        await asyncio.wait_for(decode.stream_started.wait(), 5)
        abort = generation_pb2.AbortRequest(request_id="mine")
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await cp.generation.Abort(abort, timeout=5, metadata=other)
        assert caught.value.code() == grpc.StatusCode.NOT_FOUND
        assert cp.server.cluster.ledger.is_live("mine")
        assert (await cp.generation.Abort(abort, timeout=5, metadata=owner)).aborted
        assert (await status_of(call))[0] == grpc.StatusCode.ABORTED


@run_async
async def test_another_keys_abort_of_a_finished_request_is_not_found() -> None:
    """A finished request is not revealed to another key either: its Abort is NOT_FOUND, as for
    an id never seen; its own key's Abort answers aborted=false."""
    async with control_plane(security=SECURED) as cp:
        await cp.add("p0", "prefill"), await cp.add("d0", "decode")
        owner, other = ([("authorization", f"Bearer {key}")] for key in KEYS)
        call = cp.generation.Generate(text_request(request_id="done"), timeout=10, metadata=owner)
        assert (await status_of(call))[0] == grpc.StatusCode.OK
        abort = generation_pb2.AbortRequest(request_id="done")
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await cp.generation.Abort(abort, timeout=5, metadata=other)
        assert caught.value.code() == grpc.StatusCode.NOT_FOUND
        assert not (await cp.generation.Abort(abort, timeout=5, metadata=owner)).aborted


def http_get(url: str, headers: dict[str, str]) -> tuple[int, dict[str, Any]]:
    request = urllib.request.Request(url, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


@run_async
async def test_api_keys_guard_the_http_door_with_openai_errors() -> None:
    async with control_plane(security=SECURED, http_port=0) as cp:
        await cp.add("p0", "prefill"), await cp.add("d0", "decode")
        assert cp.server.http is not None
        url = f"{cp.server.http.url}/v1"
        for key in ("wrong-key-0123456789abc", KEYS[0] + "x"):
            api = openai.AsyncOpenAI(base_url=url, api_key=key, max_retries=0)
            with pytest.raises(openai.AuthenticationError) as caught:
                await api.completions.create(model="tiny", prompt="hi", max_tokens=2)
            assert caught.value.status_code == 401
            assert caught.value.code == "invalid_api_key"
            with pytest.raises(openai.AuthenticationError):
                await api.models.list()
        status, body = await asyncio.to_thread(http_get, f"{url}/models", {})
        assert status == 401 and body["error"]["message"].startswith("missing API key")
        counter = cp.server.cluster.metrics.registry.get_sample_value
        assert counter("kvmesh_control_auth_refused_total", {"door": "http"}) == 5
        assert (await asyncio.to_thread(http_get, f"{cp.server.http.url}/health", {}))[0] == 200
        for path in ("/ping", "/version"):  # open, as /health
            assert (await asyncio.to_thread(http_get, f"{cp.server.http.url}{path}", {}))[0] == 200
        for path in ("/tokenize", "/detokenize"):  # they use the workers' tokenizers: guarded
            body = {"prompt": "hi", "tokens": [1]}
            refused = await asyncio.to_thread(httpx.post, f"{cp.server.http.url}{path}", json=body)
            assert (
                refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
            )
        assert len(cp.server.cluster.ledger) == 0 and not cp.workers[0].calls
        api = openai.AsyncOpenAI(base_url=url, api_key=KEYS[1], max_retries=0)
        done = await api.completions.create(model="tiny", prompt="hi", max_tokens=2)
        assert done.choices[0].text


@run_async
async def test_without_a_token_internal_calls_are_open_as_configured() -> None:
    """`--insecure-no-auth` (Security() without a token): nothing is checked or attached."""
    async with control_plane(security=replace(SECURED, token=None, api_keys=())) as cp:
        worker = await cp.add("d0", "decode")
        assert cp.server.internal_auth == [] and cp.server.public_auth == []
        assert cp.server.cluster.registry.get("d0") is not None
        await worker.kill()


def test_a_flood_of_forged_calls_logs_one_warning(caplog: pytest.LogCaptureFixture) -> None:
    async def scenario() -> None:
        async with control_plane(security=SECURED) as cp:
            decode = await cp.add("d0", "decode", security=WORKER)
            with caplog.at_level("WARNING", logger="kvmesh.security"):
                assert await forged_calls(cp, decode) == 15

    asyncio.run(scenario())
    refused = [r.getMessage() for r in caplog.records if r.name == "kvmesh.security"]
    assert len(refused) == 1 and "missing cluster token (1 refused" in refused[0]
