"""PrefillAhead: the prefill starts before the decode worker's reservation is known, and its KV
moves only once the call's second message names it; real workers on loopback."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
import torch
from svc_harness import NUM_BLOCKS, svc_loop, svc_model_dir, wait_until
from test_svc_disagg import ControlDriver, backends_here
from test_svc_disagg_stream import PROMPT, workers

from kv_transfer.state import TransferState
from kvmesh import LLM, SamplingParams
from kvmesh.v1 import worker_pb2
from prefill_svc.export import KVExport

__all__ = ["svc_loop", "svc_model_dir", "workers"]
MAX_TOKENS = 8
ABORTED, DEADLINE_EXCEEDED = grpc.StatusCode.ABORTED, grpc.StatusCode.DEADLINE_EXCEEDED
AHEAD_PROMPTS = {b: [200 + i, *PROMPT[1:]] for i, b in enumerate(backends_here())}


class AheadCall:
    """A PrefillAhead call whose messages the test sends one at a time."""

    def __init__(
        self, driver: ControlDriver, first: worker_pb2.PrefillRequest, timeout: float | None = 30
    ) -> None:
        self._messages: list[worker_pb2.PrefillRequest | None] = [first]
        self._ready = threading.Condition()
        self.future = driver.p.PrefillAhead.future(self._iterate(), timeout=timeout)

    def _iterate(self) -> Iterator[worker_pb2.PrefillRequest]:
        while True:
            with self._ready:
                self._ready.wait_for(lambda: bool(self._messages), timeout=30)
                message = self._messages.pop(0) if self._messages else None
            if message is None:
                return
            yield message

    def send(self, message: worker_pb2.PrefillRequest | None) -> None:
        with self._ready:
            self._messages.append(message)
            self._ready.notify()

    def outcome(self) -> tuple[grpc.StatusCode, str]:
        try:
            self.future.result(timeout=30)
        except grpc.RpcError as error:
            return error.code(), error.details() or ""
        return grpc.StatusCode.OK, ""


@pytest.fixture
def prefilled(monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """Set once a prefill's first tokens were sampled (its whole KV is final)."""
    done = threading.Event()
    record = KVExport._record

    def spy(self: KVExport, ready: Any, output: Any) -> None:
        record(self, ready, output)
        if ready is not None and ready.prefilled:
            done.set()

    monkeypatch.setattr(KVExport, "_record", spy)
    return done


@pytest.fixture
def parts(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    seen: list[tuple[int, int]] = []
    attach = KVExport.attach

    def spy(self: KVExport, handle: Any, num_blocks: int) -> None:
        add = handle.add
        handle.add = lambda offset, ids: (seen.append((offset, len(ids))), add(offset, ids))
        attach(self, handle, num_blocks)

    monkeypatch.setattr(KVExport, "attach", spy)
    return seen


@pytest.mark.parametrize("backend", backends_here())
def test_target_named_after_the_prefill_finished_matches_offline(
    workers: Any,
    svc_model_dir: Any,
    prefilled: threading.Event,
    parts: list[tuple[int, int]],
    backend: str,
) -> None:
    """The prefill computes with no destination; named afterwards, the reservation gets every
    block in one part, and decoding from it equals the offline engine token for token."""
    prefills, decode = workers
    prefill = prefills["overlap"]
    driver = ControlDriver(prefill, decode, backend)
    prompt, rid, generation = AHEAD_PROMPTS[backend], f"ahead-{backend}", 7
    request = driver.prepare(rid, prompt, temperature=0.0, max_tokens=MAX_TOKENS)
    call = AheadCall(driver, worker_pb2.PrefillRequest(request=request, generation=generation))
    assert prefilled.wait(10)
    assert not call.future.done()  # waiting for its destination, blocks held
    assert prefill.free_blocks() < NUM_BLOCKS
    reservation = driver.reserve(request, generation)
    call.send(worker_pb2.PrefillRequest(target=driver.target(reservation, generation)))
    call.send(None)
    assert call.outcome() == (grpc.StatusCode.OK, "")
    assert parts == [(0, 10)]
    tokens = [t for r in driver.decode_call(rid, reservation, generation) for t in r.token_ids]
    llm = LLM(str(svc_model_dir), num_kv_blocks=NUM_BLOCKS, max_model_len=256, num_threads=1)
    expected = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))
    assert tokens == expected[0].outputs[0].token_ids
    wait_until(lambda: prefill.free_blocks() == NUM_BLOCKS, 2.0, "prefill blocks freed")
    wait_until(lambda: decode.free_blocks() == NUM_BLOCKS, 2.0, "decode blocks freed")


def start_ahead(
    workers: Any, rid: str, generation: int, timeout: float | None = 30
) -> tuple[Any, ControlDriver, AheadCall]:
    prefills, decode = workers
    prefill = prefills["overlap"]
    driver = ControlDriver(prefill, decode, backends_here()[0])
    request = driver.prepare(rid, [300 + generation, *PROMPT[1:]], max_tokens=4)
    first = worker_pb2.PrefillRequest(request=request, generation=generation)
    call = AheadCall(driver, first, timeout)
    wait_until(lambda: prefill.free_blocks() < NUM_BLOCKS, 5.0, "prefill started")
    return prefill, driver, call


def test_a_call_ending_without_a_target_is_invalid_and_frees_everything(workers: Any) -> None:
    prefill, _, call = start_ahead(workers, "no-target", 11)
    call.send(None)
    code, details = call.outcome()
    assert code == grpc.StatusCode.INVALID_ARGUMENT and details.startswith("target:")
    wait_until(lambda: prefill.free_blocks() == NUM_BLOCKS, 2.0, "prefill blocks freed")


def test_a_target_never_named_ends_at_the_workers_bound_and_frees_everything(
    workers: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A call without a deadline that never names its target (nor ends) still ends: at the
    prefill worker's transfer bound, DEADLINE_EXCEEDED naming `target`."""
    prefill = workers[0]["overlap"]
    monkeypatch.setattr(prefill.role.servicer, "transfer_timeout", 1.0)
    _, _, call = start_ahead(workers, "never-named", 16, timeout=None)
    code, details = call.outcome()
    assert code == grpc.StatusCode.DEADLINE_EXCEEDED and details.startswith("target:")
    wait_until(lambda: prefill.free_blocks() == NUM_BLOCKS, 2.0, "prefill blocks freed")
    call.send(None)


def test_a_target_of_another_generation_is_refused_and_frees_everything(workers: Any) -> None:
    prefill, driver, call = start_ahead(workers, "stale-target", 12)
    request = driver.prepare("stale-target", [312, *PROMPT[1:]], max_tokens=4)
    reservation = driver.reserve(request, 13)
    call.send(worker_pb2.PrefillRequest(target=driver.target(reservation, 13)))
    call.send(None)
    code, details = call.outcome()
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "target.generation" in details
    wait_until(lambda: prefill.free_blocks() == NUM_BLOCKS, 2.0, "prefill blocks freed")
    release = worker_pb2.ReleaseRequest(request_id="stale-target", generation=13)
    driver.d.Release(release, timeout=5)
    wait_until(lambda: driver.decode.free_blocks() == NUM_BLOCKS, 2.0, "decode blocks freed")


def test_release_before_the_target_aborts_and_frees_everything(workers: Any) -> None:
    prefill, driver, call = start_ahead(workers, "released-early", 14)
    release = worker_pb2.ReleaseRequest(request_id="released-early", generation=14)
    assert driver.p.Release(release, timeout=5).released
    code, details = call.outcome()
    assert code == grpc.StatusCode.ABORTED and "Release" in details
    wait_until(lambda: prefill.free_blocks() == NUM_BLOCKS, 2.0, "prefill blocks freed")
    call.send(None)


def test_a_first_message_with_a_target_is_invalid(workers: Any) -> None:
    prefills, decode = workers
    driver = ControlDriver(prefills["overlap"], decode, backends_here()[0])
    request = driver.prepare("early-target", [400, *PROMPT[1:]], max_tokens=4)
    target = worker_pb2.KVTarget(generation=15)
    first = worker_pb2.PrefillRequest(request=request, target=target, generation=15)
    code, details = grpc.StatusCode.OK, ""
    try:
        driver.p.PrefillAhead(iter([first]), timeout=10)
    except grpc.RpcError as error:
        code, details = error.code(), error.details() or ""
    assert code == grpc.StatusCode.INVALID_ARGUMENT and details.startswith("target:")


@pytest.fixture
def held_final_step(monkeypatch: pytest.MonkeyPatch) -> Iterator[threading.Event]:
    """Holds a prefill's engine thread at its final step, before the step hook hands its
    sender anything, until the returned gate is set (at the latest when the test ends)."""
    gate = threading.Event()
    call = KVExport.__call__

    def spy(self: KVExport, engine: Any, request_id: str, output: Any) -> None:
        if output is not None:
            gate.wait(10)
        call(self, engine, request_id, output)

    monkeypatch.setattr(KVExport, "__call__", spy)
    yield gate
    gate.set()


def abandoned_cases() -> list[Any]:
    """(backend, ending) pairs: every backend here, released or run out of time."""
    return [
        pytest.param(backend, ending, id=f"{backend}-{ending}")
        for backend in backends_here()
        for ending in ("release", "deadline")
    ]


@pytest.mark.parametrize(("backend", "ending"), abandoned_cases())
def test_a_target_named_early_then_abandoned_leaves_no_window_and_no_write(
    workers: Any, held_final_step: threading.Event, backend: str, ending: str
) -> None:
    """The target is named while the prefill still computes (its transfer begun, the window
    granted); the call is then released or runs out of time before any block is final: the
    decode worker's transfer ends without completing, not one reserved block changed, and both
    workers free everything."""
    prefills, decode = workers
    prefill = prefills["whole"]  # nothing is final before the last step
    driver = ControlDriver(prefill, decode, backend)
    rid, generation = f"early-{ending}-{backend}", 17
    request = driver.prepare(rid, [500 + len(backend), *PROMPT[1:]], max_tokens=4)
    first = worker_pb2.PrefillRequest(request=request, generation=generation)
    call = AheadCall(driver, first, timeout=3.0 if ending == "deadline" else 30)
    reservation = driver.reserve(request, generation)
    cache = decode.runtime.kv_cache_tensors()[0]
    blocks = list(reservation.block_ids)
    before = cache[blocks].clone()
    call.send(worker_pb2.PrefillRequest(target=driver.target(reservation, generation)))
    held = decode.role.table.get(rid).handle
    wait_until(lambda: held.state is TransferState.IN_FLIGHT, 5.0, "transfer begun")
    if ending == "release":
        release = worker_pb2.ReleaseRequest(request_id=rid, generation=generation)
        assert driver.p.Release(release, timeout=5).released
    code, _ = call.outcome()
    assert code == {"release": ABORTED, "deadline": DEADLINE_EXCEEDED}[ending]
    wait_until(lambda: held.state.is_terminal, 5.0, "the decode side's transfer ended")
    assert held.state is not TransferState.COMPLETED
    held_final_step.set()
    wait_until(lambda: prefill.free_blocks() == NUM_BLOCKS, 5.0, "prefill blocks freed")
    assert torch.equal(cache[blocks], before)
    driver.d.Release(worker_pb2.ReleaseRequest(request_id=rid, generation=generation), timeout=5)
    wait_until(lambda: decode.free_blocks() == NUM_BLOCKS, 2.0, "decode blocks freed")
    call.send(None)
