"""n > 1 completions through prefill → decode over real gRPC: the prompt's KV travels once, the
decode worker forks it copy on write, and the stream matches colocated and offline serving."""

from __future__ import annotations

import argparse
from collections import defaultdict
from pathlib import Path
from typing import Any

import grpc
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
from test_svc_disagg import ControlDriver, backends_here

from decode_svc.colocated import install as install_colocated
from decode_svc.main import install as install_decode
from kvmesh import LLM, SamplingParams
from kvmesh.v1 import generation_pb2, worker_pb2, worker_pb2_grpc
from prefill_svc.main import install as install_prefill

__all__ = ["svc_loop", "svc_model_dir"]
SEEDED = {"n": 3, "temperature": 0.8, "top_p": 0.95, "seed": 1234, "max_tokens": 8, "logprobs": 1}


@pytest.fixture(scope="module")
def workers(svc_loop: Any, svc_model_dir: Path) -> Any:
    backend = backends_here()[0]
    args = argparse.Namespace(transfer_backend=[backend])
    config = engine_config(svc_model_dir)
    prefill = start_worker(svc_loop, config, "prefill", install_prefill, args)
    decode = start_worker(svc_loop, config, "decode", install_decode, args)
    colocated = start_worker(svc_loop, config, "colocated", install_colocated)
    yield ControlDriver(prefill, decode, backend), colocated
    for worker in (prefill, decode, colocated):
        worker.stop()


@pytest.fixture(scope="module")
def llm(svc_model_dir: Path) -> LLM:
    return LLM(
        str(svc_model_dir),
        num_kv_blocks=NUM_BLOCKS,
        block_size=16,
        max_num_batched_tokens=64,
        max_model_len=256,
        num_threads=1,
    )


def per_index(stream: list[Any]) -> dict[int, list[int]]:
    tokens: dict[int, list[int]] = defaultdict(list)
    for response in stream:
        tokens[response.index].extend(response.token_ids)
    return dict(tokens)


def shape(stream: list[Any]) -> dict[int, tuple[Any, ...]]:
    """What a client sees of each completion, however the responses batch its tokens (a
    reader behind the steps gets several per response), timings and log-probability values
    left out: token ids, text, finishes, each token's logprob entry."""
    seen: dict[int, tuple[list[Any], ...]] = defaultdict(lambda: ([], [], [], []))
    for r in stream:
        ids, text, finishes, entries = seen[r.index]
        ids.extend(r.token_ids)
        text.append(r.text)
        if r.finish_reason != generation_pb2.FINISH_REASON_UNSPECIFIED:
            finishes.append((r.finish_reason, r.completion_tokens))
        entries.extend((t.token_id, list(t.top_token_ids), t.token) for t in r.logprobs)
    return {i: (ids, "".join(text), f, e) for i, (ids, text, f, e) in seen.items()}


def logprob_values(stream: list[Any]) -> list[float]:
    """Every log-probability a stream carries, completion by completion, in order."""
    ordered = sorted(stream, key=lambda r: r.index)  # stable: each completion's own order
    return [v for r in ordered for t in r.logprobs for v in (t.logprob, *t.top_logprobs)]


def check_integrity(worker: RunningWorker) -> None:
    check = worker.runtime.engine.call(lambda e: e.scheduler.block_manager.check_integrity())
    worker.loop.run(check)


def all_free(driver: ControlDriver) -> bool:
    free = driver.decode.free_blocks() == driver.prefill_worker.free_blocks() == NUM_BLOCKS
    return free and not driver.decode.role.held()


def test_seeded_n3_matches_colocated_and_offline(workers: Any, llm: LLM) -> None:
    driver, colocated = workers
    prompt = list(range(40, 60))  # 20 tokens: the last block is shared part-full
    response, stream = driver.generate("seeded", prompt, ignore_eos=True, **SEEDED)
    assert response.transfer_bytes > 0 and [t.index for t in response.first_tokens] == [0, 1, 2]
    params = SamplingParams(ignore_eos=True, **SEEDED)
    (offline,) = llm.generate([prompt], params)
    expected = {out.index: out.token_ids for out in offline.outputs}
    assert per_index(stream) == expected
    assert len({tuple(ids) for ids in expected.values()}) == 3  # the seeds differ per index
    request = driver.prepare("seeded-colocated", prompt, ignore_eos=True, **SEEDED)
    stub = worker_pb2_grpc.ColocatedServiceStub(colocated.channel)
    local = list(stub.Generate(worker_pb2.ColocatedRequest(request=request)))
    assert all(len(r.logprobs) == len(r.token_ids) for r in stream)  # first ones included
    assert shape(stream) == shape(local)
    # equal up to float32 rounding: the batches the two workers ran differ in composition
    assert logprob_values(stream) == pytest.approx(logprob_values(local), rel=1e-4, abs=1e-4)
    finals = [r for r in stream if r.finish_reason != generation_pb2.FINISH_REASON_UNSPECIFIED]
    assert [(r.index, r.completion_tokens) for r in finals] == [(0, 8), (1, 8), (2, 8)]
    wait_until(lambda: all_free(driver), 1.0, "every block free on both workers")
    check_integrity(driver.decode)


def test_greedy_n2_equals_n1(workers: Any, llm: LLM) -> None:
    driver, _ = workers
    prompt = list(range(200, 232))  # 32 tokens: each fork starts a fresh block
    greedy = {"temperature": 0.0, "max_tokens": 6, "ignore_eos": True}
    _, stream = driver.generate("greedy-n2", prompt, n=2, **greedy)
    (single,) = llm.generate([prompt], SamplingParams(**greedy))
    assert per_index(stream) == {0: single.outputs[0].token_ids, 1: single.outputs[0].token_ids}
    wait_until(lambda: all_free(driver), 1.0, "every block free on both workers")


def test_first_tokens_ending_every_completion_skip_the_transfer(workers: Any) -> None:
    driver, _ = workers
    response, stream = driver.generate("one-each", [9, 8, 7], n=2, max_tokens=1, seed=5)
    assert response.transfer_bytes == 0 and len(response.first_tokens) == 2
    assert [(r.index, r.finish_reason) for r in stream] == [
        (0, generation_pb2.FINISH_REASON_LENGTH),
        (1, generation_pb2.FINISH_REASON_LENGTH),
    ]
    wait_until(lambda: all_free(driver), 1.0, "every block free on both workers")


def test_cancelled_n3_stream_frees_every_block_on_both_workers(workers: Any) -> None:
    driver, _ = workers
    request = driver.prepare("cancel-n3", list(range(10, 60)), n=3, max_tokens=150, seed=3,
                             ignore_eos=True)  # fmt: skip
    reservation = driver.reserve(request, generation=2)
    stream = driver.decode_call("cancel-n3", reservation, 2)
    driver.prefill(request, driver.target(reservation, 2))
    seen = {next(stream).index for _ in range(6)}
    assert seen == {0, 1, 2}
    assert driver.decode.free_blocks() < NUM_BLOCKS - 4  # the prompt plus private copies
    stream.cancel()
    wait_until(lambda: all_free(driver), 1.0, "every block free after cancel")
    check_integrity(driver.decode)
    check_integrity(driver.prefill_worker)


def test_reserve_holds_spares_and_refuses_n_that_cannot_fit(workers: Any) -> None:
    driver, _ = workers
    request = driver.prepare("spares", list(range(1, 21)), n=3, max_tokens=4)
    reservation = driver.reserve(request, generation=1)
    assert len(reservation.block_ids) == 2  # the prompt once
    assert driver.decode.free_blocks() == NUM_BLOCKS - 4  # + 2 spares for the forks
    for i in range(3):  # 3 x 15 blocks: 3 of the 48 are left, minus the 4 held above
        big = driver.prepare(f"big-{i}", list(range(1, 241)), max_tokens=4)
        if i == 2:
            driver.d.Release(worker_pb2.ReleaseRequest(request_id="spares"), timeout=5)
            wait_until(lambda: driver.decode.free_blocks() == NUM_BLOCKS - 30, 1.0, "spares")
        driver.reserve(big, generation=1)
    wide = driver.prepare("wide", list(range(1, 34)), n=2, max_tokens=4)  # 3 blocks + 1 spare
    with pytest.raises(grpc.RpcError) as info:
        driver.reserve(wide, generation=1)
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    details = info.value.details() or ""
    assert details.startswith("sampling.n: 2 completions need 4 KV blocks"), details
    narrow = driver.prepare("narrow", list(range(1, 34)), max_tokens=4)
    assert len(driver.reserve(narrow, generation=1).block_ids) == 3  # n = 1 still fits
    for rid in ("big-0", "big-1", "big-2", "narrow"):
        driver.d.Release(worker_pb2.ReleaseRequest(request_id=rid), timeout=5)
    wait_until(lambda: all_free(driver), 1.0, "released reservations freed")


def test_n3_without_transfer_overlap_matches_offline(
    workers: Any, llm: LLM, svc_loop: Any, svc_model_dir: Path
) -> None:
    driver, _ = workers
    args = argparse.Namespace(transfer_backend=[driver.backend], transfer_overlap=False)
    whole = start_worker(svc_loop, engine_config(svc_model_dir), "prefill", install_prefill, args)
    try:
        after = ControlDriver(whole, driver.decode, driver.backend)
        prompt = list(range(300, 345))  # 45 tokens: chunks of 64 make it one step, 3 blocks
        response, stream = after.generate("whole", prompt, ignore_eos=True, **SEEDED)
        assert response.transfer_bytes > 0
        (offline,) = llm.generate([prompt], SamplingParams(ignore_eos=True, **SEEDED))
        assert per_index(stream) == {out.index: out.token_ids for out in offline.outputs}
        wait_until(lambda: whole.free_blocks() == NUM_BLOCKS, 1.0, "prefill blocks freed")
        wait_until(lambda: all_free(driver), 1.0, "decode blocks freed")
    finally:
        whole.stop()


def test_each_completion_finishes_once_on_the_wire(workers: Any) -> None:
    """n > 1 with completions of different lengths: a completion that ended is not sent again
    (with its finish) in the responses of the steps after it, on the colocated and the
    disaggregated path."""
    driver, colocated = workers
    stub = worker_pb2_grpc.ColocatedServiceStub(colocated.channel)
    sampling = {"n": 2, "temperature": 1.0, "max_tokens": 20, "ignore_eos": True}
    stops = list(range(10, 266))  # 256 stop ids: completions end at different steps
    for seed in range(20):
        request = driver.prepare(f"ends-{seed}", [5, 6, 7, 8], seed=seed,
                                 stop_token_ids=stops, **sampling)  # fmt: skip
        local = list(stub.Generate(worker_pb2.ColocatedRequest(request=request)))
        if len({len(ids) for ids in per_index(local).values()}) == 2:
            break
    else:
        pytest.fail("no seed gave completions of different lengths")
    _, remote = driver.generate(f"ends-d-{seed}", [5, 6, 7, 8], seed=seed,
                                stop_token_ids=stops, **sampling)  # fmt: skip
    for stream in (local, remote):
        finals = [r for r in stream if r.finish_reason != generation_pb2.FINISH_REASON_UNSPECIFIED]
        assert sorted(r.index for r in finals) == [0, 1]
        assert {r.index: r.completion_tokens for r in finals} == {
            index: len(ids) for index, ids in per_index(stream).items()
        }
