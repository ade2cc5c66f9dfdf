"""A real colocated worker (tiny model) with a cluster token: every forged call (Generate,
Prepare, Prefill, Release without a token or with a wrong one) is UNAUTHENTICATED and leaves the
engine untouched; health stays open; the token itself serves."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from svc_harness import RunningWorker, engine_config, start_worker, svc_loop, svc_model_dir

from decode_svc.colocated import install
from kvmesh.security import Security
from kvmesh.v1 import generation_pb2, worker_pb2, worker_pb2_grpc

__all__ = ["svc_loop", "svc_model_dir"]
TOKEN = "svc-auth-cluster-token-0123456789"
WRONG: list[tuple[tuple[str, str], ...]] = [
    (),
    (("authorization", "Bearer svc-auth-cluster-token-0123456780"),),
    (("authorization", f"Basic {TOKEN}"),),
]


@pytest.fixture(scope="module")
def worker(svc_loop: Any, svc_model_dir: Path) -> Any:
    running = start_worker(svc_loop, engine_config(svc_model_dir), "colocated", install,
                           security=Security(token=TOKEN))  # fmt: skip
    yield running
    running.stop()


def engine_request() -> worker_pb2.EngineRequest:
    sampling = generation_pb2.SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    return worker_pb2.EngineRequest(request_id="r", prompt_ids=[5, 17, 99], sampling=sampling)


def colocated_request() -> worker_pb2.ColocatedRequest:
    return worker_pb2.ColocatedRequest(request=engine_request())


def test_forged_worker_calls_are_refused_and_leave_the_engine_untouched(
    worker: RunningWorker,
) -> None:
    colocated = worker_pb2_grpc.ColocatedServiceStub(worker.channel)
    prefill = worker_pb2_grpc.PrefillServiceStub(worker.channel)
    prompt = generation_pb2.GenerateRequest(request_id="r", text="hello")
    calls = {
        "Generate": lambda md: list(
            colocated.Generate(colocated_request(), metadata=md, timeout=5)
        ),
        "Prepare": lambda md: prefill.Prepare(
            worker_pb2.PrepareRequest(request=prompt), metadata=md, timeout=5
        ),
        "Prefill": lambda md: prefill.Prefill(
            worker_pb2.PrefillRequest(request=engine_request()), metadata=md, timeout=5
        ),
        "Release": lambda md: prefill.Release(
            worker_pb2.ReleaseRequest(request_id="r"), metadata=md, timeout=5
        ),
    }
    for name, call in calls.items():
        for metadata in WRONG:
            with pytest.raises(grpc.RpcError) as caught:
                call(metadata)
            error: Any = caught.value
            assert error.code() == grpc.StatusCode.UNAUTHENTICATED, name
            assert error.details().startswith(("missing cluster token", "wrong cluster token"))
    assert worker.server.auth[0].refused == len(calls) * len(WRONG)  # type: ignore[attr-defined]
    load = worker.runtime.engine.load()
    assert (load.free_blocks, load.running, load.waiting) == (48, 0, 0)
    health = health_pb2_grpc.HealthStub(worker.channel)
    status = health.Check(health_pb2.HealthCheckRequest(), timeout=5).status
    assert status == health_pb2.HealthCheckResponse.SERVING
    token = (("authorization", f"Bearer {TOKEN}"),)
    responses = list(colocated.Generate(colocated_request(), metadata=token, timeout=60))
    assert sum(len(r.token_ids) for r in responses) == 4


def test_token_is_checked_before_the_bytes_and_bounds_hold_with_it(worker: RunningWorker) -> None:
    """Undecodable or oversized bytes without the token are UNAUTHENTICATED (never parsed);
    with it they get the bounds' answers: INVALID_ARGUMENT naming `request` or the field."""
    from kvmesh.v1 import wire

    raw = worker.channel.unary_stream("/kvmesh.v1.ColocatedService/Generate")
    colocated = worker_pb2_grpc.ColocatedServiceStub(worker.channel)
    token = (("authorization", f"Bearer {TOKEN}"),)
    refused_before = worker.server.auth[0].refused  # type: ignore[attr-defined]
    with pytest.raises(grpc.RpcError) as caught:
        list(raw(b"\xff\xff garbage", timeout=5))
    error: Any = caught.value
    assert error.code() == grpc.StatusCode.UNAUTHENTICATED
    assert worker.server.auth[0].refused == refused_before + 1  # type: ignore[attr-defined]
    with pytest.raises(grpc.RpcError) as caught:
        list(raw(b"\xff\xff garbage", metadata=token, timeout=5))
    error = caught.value
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert wire.field_of(error) == "request"
    wide = engine_request()
    wide.sampling.n = 1000
    with pytest.raises(grpc.RpcError) as caught:
        wrapped = worker_pb2.ColocatedRequest(request=wide)
        list(colocated.Generate(wrapped, metadata=token, timeout=5))
    error = caught.value
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert wire.field_of(error) == "sampling.n"
    load = worker.runtime.engine.load()
    assert (load.free_blocks, load.running, load.waiting) == (48, 0, 0)
