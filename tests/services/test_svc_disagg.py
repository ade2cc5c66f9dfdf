"""Prefill → decode over real gRPC, driven as the control plane drives it (PROTOCOL.md)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import pytest
from svc_harness import (
    NUM_BLOCKS,
    RunningWorker,
    engine_config,
    start_worker,
    svc_loop,
    svc_model_dir,
    wait_until,
)

from decode_svc.main import install as install_decode
from kv_transfer import BACKENDS
from kvmesh import LLM, SamplingParams
from kvmesh.v1 import generation_pb2, worker_pb2, worker_pb2_grpc
from prefill_svc.main import install as install_prefill

__all__ = ["svc_loop", "svc_model_dir"]
PROMPTS = [[5, 17, 99, 300, 42], list(range(100, 170)), [7] * 33]
MAX_TOKENS = 8
CPU_BACKENDS = [name for name in ("shm", "grpc", "gloo") if name in BACKENDS]


def backends_here() -> list[str]:
    import importlib

    found: list[str] = []
    for name in CPU_BACKENDS:
        try:
            importlib.import_module(BACKENDS[name])
        except ImportError:
            continue
        found.append(name)
    return found


@pytest.fixture(scope="module")
def pair(svc_loop: Any, svc_model_dir: Path) -> Any:
    args = argparse.Namespace(transfer_backend=backends_here())
    config = engine_config(svc_model_dir)
    prefill = start_worker(svc_loop, config, "prefill", install_prefill, args)
    decode = start_worker(svc_loop, config, "decode", install_decode, args)
    yield prefill, decode
    prefill.stop()
    decode.stop()


@pytest.fixture(scope="module")
def offline(svc_model_dir: Path) -> list[list[int]]:
    llm = LLM(str(svc_model_dir), num_kv_blocks=NUM_BLOCKS, max_model_len=256, num_threads=1)
    outputs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))
    return [out.outputs[0].token_ids for out in outputs]


class ControlDriver:
    """The control plane's side of one request: Prepare, Reserve, Prefill, Decode."""

    def __init__(self, prefill: RunningWorker, decode: RunningWorker, backend: str) -> None:
        self.p = worker_pb2_grpc.PrefillServiceStub(prefill.channel)
        self.d = worker_pb2_grpc.DecodeServiceStub(decode.channel)
        self.prefill_worker, self.decode = prefill, decode
        self.backend = backend

    def prepare(self, rid: str, ids: list[int], **sampling: Any) -> worker_pb2.EngineRequest:
        request = generation_pb2.GenerateRequest(
            request_id=rid,
            token_ids=generation_pb2.TokenIds(ids=ids),
            sampling=generation_pb2.SamplingParams(**sampling),
        )
        return self.p.Prepare(worker_pb2.PrepareRequest(request=request), timeout=10).request

    def reserve(
        self, request: worker_pb2.EngineRequest, generation: int, lease: float = 10.0
    ) -> worker_pb2.ReserveResponse:
        message = worker_pb2.ReserveRequest(
            request=request, generation=generation, lease_seconds=lease
        )
        return self.d.Reserve(message, timeout=10)

    def target(
        self, reservation: worker_pb2.ReserveResponse, generation: int
    ) -> worker_pb2.KVTarget:
        endpoints = self.decode.role.transfer_endpoints
        return worker_pb2.KVTarget(
            worker_id="decode-test",
            epoch=reservation.epoch,
            generation=generation,
            backend=self.backend,
            endpoint=endpoints[self.backend],
            block_ids=reservation.block_ids,
            transfer_id=reservation.transfer_id,
            layout=reservation.layout,
        )

    def prefill(
        self, request: worker_pb2.EngineRequest, target: worker_pb2.KVTarget
    ) -> worker_pb2.PrefillResponse:
        message = worker_pb2.PrefillRequest(request=request, target=target)
        return self.p.Prefill(message, timeout=30)

    def decode_call(
        self,
        rid: str,
        reservation: worker_pb2.ReserveResponse,
        generation: int,
    ) -> Any:
        message = worker_pb2.DecodeRequest(
            request_id=rid,
            epoch=reservation.epoch,
            generation=generation,
            transfer_id=reservation.transfer_id,
        )
        return self.d.Decode(message, timeout=30)

    def generate(self, rid: str, ids: list[int], generation: int = 1, **sampling: Any) -> Any:
        """As the control plane does: Decode opened right after Reserve, while Prefill runs
        (the first tokens come with the KV)."""
        request = self.prepare(rid, ids, **sampling)
        reservation = self.reserve(request, generation)
        stream = self.decode_call(rid, reservation, generation)
        response = self.prefill(request, self.target(reservation, generation))
        return response, list(stream)


@pytest.mark.parametrize("backend", backends_here())
def test_disaggregated_greedy_matches_offline(
    pair: Any, offline: list[list[int]], backend: str
) -> None:
    prefill, decode = pair
    driver = ControlDriver(prefill, decode, backend)
    for i, prompt in enumerate(PROMPTS):
        rid = f"{backend}-{i}"
        response, stream = driver.generate(rid, prompt, temperature=0.0, max_tokens=MAX_TOKENS)
        assert response.transfer_bytes > 0
        tokens = [t for r in stream for t in r.token_ids]
        assert tokens[0] == response.first_tokens[0].token_id
        assert tokens == offline[i], f"prompt {i} over {backend}"
        assert stream[-1].finish_reason == generation_pb2.FINISH_REASON_LENGTH
        assert stream[-1].completion_tokens == MAX_TOKENS
    wait_until(lambda: decode.free_blocks() == NUM_BLOCKS, 1.0, "decode blocks freed")
    wait_until(lambda: prefill.free_blocks() == NUM_BLOCKS, 1.0, "prefill blocks freed")
    if backend == "shm":  # one copy into the decode worker's cache, which lives in a memfd
        region = decode.role.table.receivers["shm"].store.region
        assert region is not None
        region.offset_of(decode.runtime.kv_cache_tensors()[0])  # the engine's cache is in it
        senders = prefill.role.senders.idle("shm")
        assert senders and all(s.registered for s in senders)


def test_decode_stream_logprobs_carry_token_text(pair: Any, svc_model_dir: Path) -> None:
    """The decode worker fills each logprob's token text (the first token's too)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(svc_model_dir)
    driver = ControlDriver(*pair, backends_here()[0])
    prompt = [ord(c) for c in "logprob text"]
    _, stream = driver.generate("lp-text", prompt, temperature=0.0, max_tokens=4, logprobs=2)
    logprobs = [lp for r in stream for lp in r.logprobs]
    assert [lp.token_id for lp in logprobs] == [t for r in stream for t in r.token_ids]
    for lp in logprobs:
        assert lp.token == tokenizer.decode([lp.token_id], skip_special_tokens=False)
        assert list(lp.top_tokens) == [tokenizer.decode([i]) for i in lp.top_token_ids]
        assert len(lp.top_token_bytes) == len(lp.top_token_ids)
    assert any(lp.token for lp in logprobs) and len(logprobs) == 4
    joined = b"".join(lp.token_bytes for lp in logprobs)  # the first token's (prefill's) too
    ids = [lp.token_id for lp in logprobs]
    assert joined.decode(errors="replace") == tokenizer.decode(ids, skip_special_tokens=False)
