"""One request that raises in the engine's step, on a real colocated worker over gRPC: that call
ends INTERNAL naming the request, the calls streaming beside it finish with the tokens and text
they have alone, no KV block stays held, and the worker keeps serving.

The trigger is a real input (see tests/engine/test_engine_request_fault.py): the tiny Llama
(vocabulary 1024) with transformers' ByT5Tokenizer (384 ids), whose decode raises ValueError for
a prompt token id the model accepts but the tokenizer cannot decode.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
import pytest
from svc_harness import NUM_BLOCKS, RunningWorker, engine_config, start_worker, svc_loop, wait_until

from decode_svc.colocated import install
from kvmesh.v1 import generation_pb2, worker_pb2, worker_pb2_grpc
from tests.checkpoints import BYT5_TOKENIZER_IDS, byt5_checkpoint

__all__ = ["svc_loop"]
# the good requests' tokens stay decodable
BIAS = {i: -100.0 for i in range(BYT5_TOKENIZER_IDS, 1024)}
GOOD = {"temperature": 0.0, "max_tokens": 12, "ignore_eos": True, "logit_bias": BIAS}
GOOD_PROMPTS = {"good-a": list(range(40, 60)), "good-b": [72, 101, 108, 108, 111, 33, 32, 200]}
BAD_PROMPT = [72, 105, 500, 33]  # 500: in the model's vocabulary, not the tokenizer's


@pytest.fixture(scope="module")
def worker(svc_loop: Any, tmp_path_factory: pytest.TempPathFactory) -> Any:
    folder = byt5_checkpoint(tmp_path_factory.mktemp("svc-byt5"))
    running = start_worker(svc_loop, engine_config(folder), "colocated", install)
    yield running
    running.stop()


def generate(worker: RunningWorker, rid: str, ids: list[int], **sampling: Any) -> Any:
    """(token ids, text, finish reason) of one Generate call, or the RpcError that ended it."""
    request = worker_pb2.EngineRequest(
        request_id=rid, prompt_ids=ids, sampling=generation_pb2.SamplingParams(**sampling)
    )
    stub = worker_pb2_grpc.ColocatedServiceStub(worker.channel)
    try:
        responses = list(stub.Generate(worker_pb2.ColocatedRequest(request=request), timeout=60))
    except grpc.RpcError as error:
        return error
    tokens = [t for r in responses for t in r.token_ids]
    return tokens, "".join(r.text for r in responses), responses[-1].finish_reason


def test_a_failing_request_ends_internal_and_the_others_finish(worker: RunningWorker) -> None:
    alone = {rid: generate(worker, rid, ids, **GOOD) for rid, ids in GOOD_PROMPTS.items()}
    for result in alone.values():
        assert not isinstance(result, grpc.RpcError), result
        assert result[2] == generation_pb2.FINISH_REASON_LENGTH

    calls = {**{f"{rid}-2": (ids, GOOD) for rid, ids in GOOD_PROMPTS.items()}}
    calls["bad"] = (BAD_PROMPT, {"temperature": 0.0, "max_tokens": 12, "ignore_eos": True})
    with ThreadPoolExecutor(len(calls)) as pool:
        futures = {
            rid: pool.submit(generate, worker, rid, ids, **params)
            for rid, (ids, params) in calls.items()
        }
        results = {rid: future.result() for rid, future in futures.items()}

    bad = results.pop("bad")
    assert isinstance(bad, grpc.RpcError)
    assert bad.code() == grpc.StatusCode.INTERNAL, bad
    assert "'bad'" in bad.details() and "ValueError" in bad.details()
    assert results == {f"{rid}-2": result for rid, result in alone.items()}
    wait_until(lambda: worker.free_blocks() == NUM_BLOCKS, 2.0, "every block free")
    assert worker.runtime.engine.error is None
    again = generate(worker, "good-a-3", GOOD_PROMPTS["good-a"], **GOOD)
    assert again == alone["good-a"]
