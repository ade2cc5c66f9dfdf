"""A colocated worker over real gRPC: a second Generate that reuses the request id of a running
one is refused or gives up without touching the running request. Here the second call's
deadline ends while its open waits behind the engine thread (held busy, as by a long step);
its cleanup used to abort the running request by id, whose stream then got no more output."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import grpc
import pytest
from svc_harness import (
    RunningWorker,
    engine_config,
    start_worker,
    svc_loop,
    svc_model_dir,
    wait_until,
)

from decode_svc.colocated import install
from kvmesh.v1 import generation_pb2, worker_pb2, worker_pb2_grpc

__all__ = ["svc_loop", "svc_model_dir"]
MAX_TOKENS = 40


@pytest.fixture(scope="module")
def colocated(svc_loop: Any, svc_model_dir: Path) -> Any:
    worker = start_worker(svc_loop, engine_config(svc_model_dir), "colocated", install)
    yield worker
    worker.stop()


def call(rid: str, prompt: list[int]) -> worker_pb2.ColocatedRequest:
    sampling = generation_pb2.SamplingParams(
        temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True
    )
    request = worker_pb2.EngineRequest(request_id=rid, prompt_ids=prompt, sampling=sampling)
    return worker_pb2.ColocatedRequest(request=request)


def held(worker: RunningWorker, rid: str) -> bool:
    """The worker's engine still runs `rid` (asked after every command queued before)."""
    engine = worker.runtime.engine
    return bool(worker.loop.run(engine.call(lambda e: e.scheduler.get_request(rid) is not None)))


def test_a_duplicate_id_that_gives_up_leaves_the_running_request(
    colocated: RunningWorker,
) -> None:
    stub = worker_pb2_grpc.ColocatedServiceStub(colocated.channel)
    running = stub.Generate(call("shared", list(range(10, 30))), timeout=60)
    first = next(running)
    with pytest.raises(grpc.RpcError) as refused:  # a duplicate that waits is refused by name
        list(stub.Generate(call("shared", [40, 41, 42]), timeout=10))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert (refused.value.details() or "").startswith("request_id")
    engine = colocated.runtime.engine
    gate = threading.Event()
    engine.submit(lambda e: gate.wait(30))  # the engine thread is busy until the gate opens
    try:
        with pytest.raises(grpc.RpcError) as gave_up:
            list(stub.Generate(call("shared", [40, 41, 42]), timeout=0.5))
        assert gave_up.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        # its open, then its cleanup, wait behind the busy engine thread
        wait_until(lambda: engine._commands.qsize() >= 2, 10.0, "the duplicate's cleanup")
    finally:
        gate.set()
    assert held(colocated, "shared")
    rest = list(running)
    tokens = [t for r in [first, *rest] for t in r.token_ids]
    assert len(tokens) == MAX_TOKENS
    assert rest[-1].finish_reason == generation_pb2.FINISH_REASON_LENGTH
    wait_until(lambda: colocated.free_blocks() == engine.load().total_blocks, 2.0, "blocks free")
