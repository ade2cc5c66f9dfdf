"""A prefill worker's own metrics over real gRPC (real engines, real transfers): every call of
its request path counted by status, caller cancels included, and `kvmesh_kv_transfer_seconds`
observing every transfer, given up or not, from the sender's start to its end."""

from __future__ import annotations

import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import grpc
from prometheus_client.parser import text_string_to_metric_families
from svc_harness import NUM_BLOCKS, engine_config, start_worker, svc_loop, svc_model_dir, wait_until
from test_svc_disagg import ControlDriver, backends_here
from test_svc_disagg_stream import PROMPT, workers
from test_svc_prefill_ahead import AheadCall, held_final_step, prefilled

from decode_svc.colocated import install as install_colocated
from kv_transfer.state import TransferState
from kvmesh.service.process import bind_engine_metrics
from kvmesh.telemetry.metrics import WorkerMetrics, serve_metrics
from kvmesh.v1 import generation_pb2, worker_pb2, worker_pb2_grpc

__all__ = ["held_final_step", "prefilled", "svc_loop", "svc_model_dir", "workers"]
TARGET_LATE_SECONDS = 1.0


def sample(worker: Any, name: str, **labels: str) -> float:
    """A sample of `worker`'s registry (0 when absent)."""
    registry = worker.role.servicer.metrics.registry
    return registry.get_sample_value(name, labels) or 0.0


def test_a_prefill_cancelled_by_its_caller_mid_transfer_is_counted(
    workers: Any, held_final_step: threading.Event
) -> None:
    """The control plane cancels a Prefill call when its client leaves, its deadline passes or
    it is aborted: the call is counted CANCELLED (as a decode worker counts its own), and the
    transfer it gave up is observed as a failure (`status="CANCELLED"`), as its span is."""
    prefills, decode = workers
    prefill = prefills["whole"]  # nothing is final before the last step, held here
    backend = backends_here()[0]
    driver = ControlDriver(prefill, decode, backend)
    calls = ("kvmesh_requests_total", {"status": "CANCELLED"})
    transfers = ("kvmesh_kv_transfer_seconds_count", {"backend": backend, "status": "CANCELLED"})
    before = [sample(prefill, name, **labels) for name, labels in (calls, transfers)]
    rid, generation = "cancelled-by-caller", 21
    request = driver.prepare(rid, [700, *PROMPT[1:]], max_tokens=4)
    call = AheadCall(driver, worker_pb2.PrefillRequest(request=request, generation=generation))
    reservation = driver.reserve(request, generation)
    call.send(worker_pb2.PrefillRequest(target=driver.target(reservation, generation)))
    call.send(None)
    held = decode.role.table.get(rid).handle
    wait_until(lambda: held.state is TransferState.IN_FLIGHT, 5.0, "transfer begun")
    assert call.future.cancel()
    after = [before[0] + 1, before[1] + 1]
    wait_until(
        lambda: [sample(prefill, name, **labels) for name, labels in (calls, transfers)] == after,
        2.0,
        "the cancelled call and its transfer counted",
    )
    held_final_step.set()
    wait_until(lambda: prefill.free_blocks() == NUM_BLOCKS, 5.0, "prefill blocks freed")
    driver.d.Release(worker_pb2.ReleaseRequest(request_id=rid, generation=generation), timeout=5)
    wait_until(lambda: decode.free_blocks() == NUM_BLOCKS, 2.0, "decode blocks freed")


def test_transfer_seconds_is_the_transfer_not_the_wait_for_its_target(
    workers: Any, prefilled: threading.Event
) -> None:
    """A target named a second after the prefill finished: the transfer itself takes
    milliseconds on loopback, and that is what the histogram observes (as the span's
    `kvmesh.transfer.duration_seconds`), not the wait for the reservation."""
    prefills, decode = workers
    prefill = prefills["overlap"]
    backend = backends_here()[0]
    driver = ControlDriver(prefill, decode, backend)
    labels = {"backend": backend, "status": "OK"}
    count = sample(prefill, "kvmesh_kv_transfer_seconds_count", **labels)
    total = sample(prefill, "kvmesh_kv_transfer_seconds_sum", **labels)
    rid, generation = "late-target", 22
    request = driver.prepare(rid, [600, *PROMPT[1:]], temperature=0.0, max_tokens=4)
    call = AheadCall(driver, worker_pb2.PrefillRequest(request=request, generation=generation))
    assert prefilled.wait(10)
    time.sleep(TARGET_LATE_SECONDS)  # the decode worker's reservation is late
    reservation = driver.reserve(request, generation)
    call.send(worker_pb2.PrefillRequest(target=driver.target(reservation, generation)))
    call.send(None)
    assert call.outcome() == (grpc.StatusCode.OK, "")
    assert sample(prefill, "kvmesh_kv_transfer_seconds_count", **labels) == count + 1
    observed = sample(prefill, "kvmesh_kv_transfer_seconds_sum", **labels) - total
    assert 0 < observed < TARGET_LATE_SECONDS / 2
    driver.d.Release(worker_pb2.ReleaseRequest(request_id=rid, generation=generation), timeout=5)
    wait_until(lambda: decode.free_blocks() == NUM_BLOCKS, 2.0, "decode blocks freed")
    wait_until(lambda: prefill.free_blocks() == NUM_BLOCKS, 2.0, "prefill blocks freed")


def test_a_prefill_ahead_cancelled_before_its_target_is_counted_cancelled(workers: Any) -> None:
    """A client that leaves while the decode worker reserves cancels the PrefillAhead call
    before its target is named: the worker's read of the request stream then ends, which
    must not be taken for a caller that closed the stream without a target."""
    prefills, decode = workers
    prefill = prefills["overlap"]
    driver = ControlDriver(prefill, decode, backends_here()[0])
    codes = ("CANCELLED", "INVALID_ARGUMENT")
    before = [sample(prefill, "kvmesh_requests_total", status=code) for code in codes]
    for index in range(5):
        request = driver.prepare(f"left-early-{index}", [710 + index, *PROMPT[1:]], max_tokens=4)
        first = worker_pb2.PrefillRequest(request=request, generation=31 + index)
        call = AheadCall(driver, first)
        wait_until(lambda: prefill.free_blocks() < NUM_BLOCKS, 5.0, "prefill started")
        assert call.future.cancel()
        wait_until(lambda: prefill.free_blocks() == NUM_BLOCKS, 5.0, "prefill blocks freed")
        call.send(None)
    expected = [before[0] + 5, before[1]]
    wait_until(
        lambda: [sample(prefill, "kvmesh_requests_total", status=c) for c in codes] == expected,
        2.0,
        "five calls counted CANCELLED, none INVALID_ARGUMENT",
    )


def scraped_blocks(port: int) -> dict[str, float]:
    """`kvmesh_kv_blocks` by state, scraped from a worker's /metrics."""
    url = f"http://127.0.0.1:{port}/metrics"
    text = urllib.request.urlopen(url, timeout=5).read().decode()
    (family,) = [f for f in text_string_to_metric_families(text) if f.name == "kvmesh_kv_blocks"]
    return {sample.labels["state"]: sample.value for sample in family.samples}


class StepHold:
    """A step observer that, once `hold` is set, holds the engine thread at its next step
    until `go` (the load snapshot then stays that of the step before)."""

    def __init__(self) -> None:
        self.hold, self.held, self.go = threading.Event(), threading.Event(), threading.Event()

    def __call__(self, tokens: int) -> None:
        if self.hold.is_set() and not self.go.is_set():
            self.held.set()
            self.go.wait(10)


def test_cached_kv_blocks_are_the_free_blocks_that_still_hold_a_prefix(
    svc_loop: Any, svc_model_dir: Path
) -> None:
    """`kvmesh_kv_blocks{state="cached"}` is a subset of `free`: while a request decodes, its
    own prompt blocks (published in the prefix index, but in use) are `used`, not `cached`;
    once it finished they are free and cached."""
    worker = start_worker(svc_loop, engine_config(svc_model_dir), "colocated", install_colocated)
    hold = StepHold()
    try:
        metrics = WorkerMetrics("colocated")
        bind_engine_metrics(metrics, worker.runtime)
        port = serve_metrics(metrics, 0)
        worker.runtime.engine.engine.step_observers.append(hold)
        sampling = generation_pb2.SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
        prompt = [100 + i for i in range(160)]  # 10 full blocks
        request = worker_pb2.EngineRequest(request_id="cached-blocks", prompt_ids=prompt,
                                           sampling=sampling)  # fmt: skip
        stub = worker_pb2_grpc.ColocatedServiceStub(worker.channel)
        stream = stub.Generate(worker_pb2.ColocatedRequest(request=request), timeout=30)
        next(stream)  # prefilled: decoding now
        hold.hold.set()
        assert hold.held.wait(10)
        decoding = scraped_blocks(port)
        hold.go.set()
        assert list(stream)[-1].finish_reason == generation_pb2.FINISH_REASON_LENGTH
        wait_until(lambda: worker.runtime.engine.load().running == 0, 5.0, "the request ended")
        finished = scraped_blocks(port)
    finally:
        hold.go.set()
        worker.stop()
    assert decoding["used"] >= 10 and decoding["used"] + decoding["free"] == NUM_BLOCKS
    assert decoding["cached"] == 0  # every prompt block is the running request's
    assert finished["used"] == 0 and finished["free"] == NUM_BLOCKS
    assert 10 <= finished["cached"] <= finished["free"]
