"""ColocatedService over real gRPC: same tokens as the offline engine, precise errors, cleanup."""

from __future__ import annotations

import math
import time
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
from kvmesh import LLM, SamplingParams
from kvmesh.v1 import generation_pb2, worker_pb2, worker_pb2_grpc

__all__ = ["svc_loop", "svc_model_dir"]
PROMPTS = [[5, 17, 99, 300, 42], list(range(100, 170)), [7] * 33]
MAX_TOKENS = 10


@pytest.fixture(scope="module")
def colocated(svc_loop: Any, svc_model_dir: Path) -> Any:
    worker = start_worker(svc_loop, engine_config(svc_model_dir), "colocated", install)
    yield worker
    worker.stop()


def engine_request(rid: str, ids: list[int], **sampling: Any) -> worker_pb2.EngineRequest:
    params = generation_pb2.SamplingParams(**sampling)
    return worker_pb2.EngineRequest(request_id=rid, prompt_ids=ids, sampling=params)


def generate(worker: RunningWorker, request: worker_pb2.EngineRequest) -> list[Any]:
    stub = worker_pb2_grpc.ColocatedServiceStub(worker.channel)
    return list(stub.Generate(worker_pb2.ColocatedRequest(request=request), timeout=60))


def test_generate_matches_offline_engine(colocated: RunningWorker, svc_model_dir: Path) -> None:
    llm = LLM(str(svc_model_dir), num_kv_blocks=48, max_model_len=256, num_threads=1)
    offline = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))
    for i, prompt in enumerate(PROMPTS):
        request = engine_request(f"greedy-{i}", prompt, temperature=0.0, max_tokens=MAX_TOKENS)
        responses = generate(colocated, request)
        tokens = [t for r in responses for t in r.token_ids]
        assert tokens == offline[i].outputs[0].token_ids
        last = responses[-1]
        assert last.finish_reason != generation_pb2.FINISH_REASON_UNSPECIFIED
        assert last.completion_tokens == len(tokens)
        assert "".join(r.text for r in responses) == offline[i].outputs[0].text
    wait_until(lambda: colocated.free_blocks() == 48, 1.0, "all blocks free")


def test_prepare_tokenizes_text(colocated: RunningWorker) -> None:
    stub = worker_pb2_grpc.PrefillServiceStub(colocated.channel)
    request = generation_pb2.GenerateRequest(request_id="p", text="hi")
    prepared = stub.Prepare(worker_pb2.PrepareRequest(request=request), timeout=10).request
    assert list(prepared.prompt_ids) == [256, ord("h"), ord("i")]


def test_generate_prepares_the_clients_text_itself(colocated: RunningWorker) -> None:
    """Given the client's request, the worker tokenizes it (as Prepare would) and streams the
    same tokens as for the prepared request, the prompt's length in its first response."""
    stub = worker_pb2_grpc.ColocatedServiceStub(colocated.channel)
    sampling = generation_pb2.SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    client = generation_pb2.GenerateRequest(request_id="text", text="hi there", sampling=sampling)
    from_text = list(stub.Generate(worker_pb2.ColocatedRequest(prompt=client), timeout=60))
    prepared = engine_request("ids", [256, *b"hi there"], temperature=0.0, max_tokens=MAX_TOKENS)
    from_ids = generate(colocated, prepared)
    assert [t for r in from_text for t in r.token_ids] == [t for r in from_ids for t in r.token_ids]
    assert [r.prompt_tokens for r in from_text][:2] == [9, 0]
    empty = generation_pb2.GenerateRequest(request_id="empty", text="x" * (1 << 20))
    with pytest.raises(grpc.RpcError) as info:
        list(stub.Generate(worker_pb2.ColocatedRequest(prompt=empty), timeout=10))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT  # type: ignore[attr-defined]
    assert (info.value.details() or "").startswith("prompt.text")  # type: ignore[attr-defined]
    wait_until(lambda: colocated.free_blocks() == 48, 1.0, "all blocks free")


BAD = [
    ("prompt", {"prompt_ids": []}),
    ("prompt.token_ids", {"prompt_ids": [1, 5000]}),
    ("prompt", {"prompt_ids": list(range(1, 250)), "max_tokens": 1}),
    ("max_tokens", {"max_tokens": 0}),
    ("temperature", {"temperature": math.nan}),
    ("stop", {"stop": ["x"] * 40}),
    ("stop", {"stop": ["y" * 1000]}),
]


@pytest.mark.parametrize(("field", "change"), BAD, ids=[f"{f}-{i}" for i, (f, _) in enumerate(BAD)])
def test_bad_input_is_invalid_argument_naming_the_field(
    colocated: RunningWorker, field: str, change: dict[str, Any]
) -> None:
    ids = change.pop("prompt_ids", [1, 2, 3])
    if field == "prompt" and len(ids) > 200:
        ids = list(range(1, 300))  # longer than max_model_len 256
    with pytest.raises(grpc.RpcError) as info:
        generate(colocated, engine_request(f"bad-{field}", ids, **change))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert (info.value.details() or "").startswith(field), info.value.details()
    assert colocated.free_blocks() == 48


def test_cancel_mid_stream_frees_blocks(colocated: RunningWorker) -> None:
    stub = worker_pb2_grpc.ColocatedServiceStub(colocated.channel)
    request = engine_request("cancel-me", list(range(10, 60)), max_tokens=150, ignore_eos=True)
    call = stub.Generate(worker_pb2.ColocatedRequest(request=request), timeout=60)
    first = next(call)
    assert first.token_ids
    assert colocated.free_blocks() < 48
    call.cancel()
    wait_until(lambda: colocated.free_blocks() == 48, 1.0, "blocks freed after cancel")


def test_sizes_are_bounded_before_any_conversion(colocated: RunningWorker) -> None:
    """Millions of ids, n = 1000, 1 MiB of text, an undecodable or oversized message: each is
    refused at once, naming the field, with the BadRequest detail."""
    from google.rpc import error_details_pb2
    from grpc_status import rpc_status

    def refused(call: Any, code: grpc.StatusCode = grpc.StatusCode.INVALID_ARGUMENT) -> str:
        started = time.monotonic()
        with pytest.raises(grpc.RpcError) as info:
            call()
        assert time.monotonic() - started < 2.0
        assert info.value.code() == code, info.value.details()
        if code != grpc.StatusCode.INVALID_ARGUMENT:
            return ""
        status = rpc_status.from_call(info.value)
        bad = error_details_pb2.BadRequest()
        assert status is not None and status.details[0].Unpack(bad)
        return str(bad.field_violations[0].field)

    many = engine_request("many", [1] * 2_000_000)
    assert refused(lambda: generate(colocated, many)) == "prompt.token_ids"
    wide = engine_request("wide", [1, 2], n=1000)
    assert refused(lambda: generate(colocated, wide)) == "sampling.n"
    prepare = worker_pb2_grpc.PrefillServiceStub(colocated.channel).Prepare
    text = worker_pb2.PrepareRequest(
        request=generation_pb2.GenerateRequest(request_id="t", text="x" * (1 << 20))
    )
    assert refused(lambda: prepare(text, timeout=10)) == "prompt.text"
    raw = colocated.channel.unary_stream("/kvmesh.v1.ColocatedService/Generate")
    assert refused(lambda: list(raw(b"\xff\xff garbage", timeout=10))) == "request"
    huge = engine_request("huge", [1 << 28] * 4_000_000)  # 20 MB: beyond the 16 MiB limit
    refused(lambda: generate(colocated, huge), grpc.StatusCode.RESOURCE_EXHAUSTED)
    assert colocated.free_blocks() == 48
