"""A prefill worker refuses bad calls precisely and early, and a stalled decode worker costs
only its own calls: real prefill and decode workers on loopback."""

from __future__ import annotations

import argparse
import gc
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from svc_harness import NUM_BLOCKS, engine_config, start_worker, svc_loop, svc_model_dir, wait_until
from test_svc_disagg import ControlDriver, backends_here

from decode_svc.main import install as install_decode
from kvmesh.v1 import wire, worker_pb2
from prefill_svc.main import install as install_prefill

__all__ = ["svc_loop", "svc_model_dir"]
PROMPT = list(range(10, 40))
BAD_ENDPOINTS = ("", "bogus", "unix:", "127.0.0.1:notaport", "\u00e9:1", "x" * 300)


@pytest.fixture(scope="module")
def pair(svc_loop: Any, svc_model_dir: Path) -> Any:
    backends = backends_here()
    args = argparse.Namespace(transfer_backend=backends)
    prefill = start_worker(svc_loop, engine_config(svc_model_dir), "prefill", install_prefill, args)
    decode = start_worker(svc_loop, engine_config(svc_model_dir), "decode", install_decode, args)
    yield prefill, decode
    prefill.stop()
    decode.stop()


def test_a_stalled_decode_worker_does_not_hold_up_connects_to_a_healthy_one(
    pair: Any, stalled: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Prefills aimed at a decode worker that accepts and never answers the KV handshake end
    at their own deadline (DEADLINE_EXCEEDED naming `target`), and a Prefill to a healthy
    decode worker that needs a new connection meanwhile goes through at once. The failed
    connects of calls that already left log nothing ("exception was never retrieved")."""
    if "shm" not in backends_here():
        pytest.skip("needs the shm backend")
    prefill, decode = pair
    driver = ControlDriver(prefill, decode, "shm")
    request = driver.prepare("healthy", PROMPT, max_tokens=4)
    good = driver.target(driver.reserve(request, 1), 1)
    while (idle := prefill.role.senders.take_idle("shm", good.endpoint)) is not None:
        idle.close()  # the healthy call must connect
    bad = worker_pb2.KVTarget()
    bad.CopyFrom(good)
    bad.endpoint = stalled
    stuck = []
    for i in range(8):
        message = worker_pb2.PrefillRequest(
            request=driver.prepare(f"stalled-{i}", PROMPT, max_tokens=4), target=bad
        )
        stuck.append(driver.p.Prefill.future(message, timeout=1.0))
    time.sleep(0.3)
    try:
        start = time.monotonic()
        driver.p.Prefill(worker_pb2.PrefillRequest(request=request, target=good), timeout=10)
        assert time.monotonic() - start < 2.0
        for call in stuck:
            with pytest.raises(grpc.RpcError) as failed:
                call.result(timeout=5)
            assert failed.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    finally:
        driver.d.Release(worker_pb2.ReleaseRequest(request_id="healthy"), timeout=5)
    wait_until(lambda: prefill.free_blocks() == NUM_BLOCKS, 3.0, "prefill blocks freed")
    wait_until(lambda: not prefill.role.servicer.active, 3.0, "no prefill in progress")
    gc.collect()
    assert not [r for r in caplog.records if "never retrieved" in r.getMessage()]


def test_a_stalled_connect_ends_at_the_workers_bound_for_a_call_without_deadline(
    pair: Any, stalled: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without a call deadline, the handshake with a stalled decode worker ends at the
    worker's transfer bound: DEADLINE_EXCEEDED naming `target`, not the 10 s handshake bound
    nor UNAVAILABLE (which would read as the prefill worker being lost)."""
    if "shm" not in backends_here():
        pytest.skip("needs the shm backend")
    prefill, decode = pair
    monkeypatch.setattr(prefill.role.servicer, "transfer_timeout", 1.0)
    driver = ControlDriver(prefill, decode, "shm")
    request = driver.prepare("stalled-bound", PROMPT, max_tokens=4)
    target = driver.target(driver.reserve(request, 1), 1)
    target.endpoint = stalled
    start = time.monotonic()
    with pytest.raises(grpc.RpcError) as failed:
        driver.p.Prefill(worker_pb2.PrefillRequest(request=request, target=target))
    assert time.monotonic() - start < 4.0
    assert failed.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert (failed.value.details() or "").startswith("target:")
    driver.d.Release(worker_pb2.ReleaseRequest(request_id="stalled-bound"), timeout=5)
    wait_until(lambda: prefill.free_blocks() == NUM_BLOCKS, 3.0, "prefill blocks freed")


@pytest.mark.parametrize("backend", backends_here())
def test_a_malformed_target_endpoint_is_invalid_naming_it(pair: Any, backend: str) -> None:
    """An endpoint that cannot be an address of the target's backend is INVALID_ARGUMENT
    naming `target.endpoint`, before anything starts (not UNAVAILABLE, which reads as the
    prefill worker being lost)."""
    prefill, decode = pair
    driver = ControlDriver(prefill, decode, backend)
    request = driver.prepare("bad-endpoint", PROMPT, max_tokens=4)
    reservation = driver.reserve(request, 1)
    try:
        for endpoint in BAD_ENDPOINTS:
            target = driver.target(reservation, 1)
            target.endpoint = endpoint
            with pytest.raises(grpc.RpcError) as failed:
                driver.prefill(request, target)
            assert failed.value.code() == grpc.StatusCode.INVALID_ARGUMENT, endpoint
            assert wire.field_of(failed.value) == "target.endpoint", endpoint
        assert prefill.free_blocks() == NUM_BLOCKS and not prefill.role.servicer.active
    finally:
        driver.d.Release(worker_pb2.ReleaseRequest(request_id="bad-endpoint"), timeout=5)


def _ahead_raw(prefill: Any) -> Any:
    return prefill.channel.stream_unary(
        "/kvmesh.v1.PrefillService/PrefillAhead",
        request_serializer=None,
        response_deserializer=worker_pb2.PrefillResponse.FromString,
    )


def test_an_undecodable_prefill_ahead_message_is_invalid_naming_the_field(pair: Any) -> None:
    """A PrefillAhead message that is not a valid PrefillRequest, or has a string that is not
    UTF-8, is INVALID_ARGUMENT naming the field (as a unary Prefill is), not INTERNAL."""
    prefill, _ = pair
    first = worker_pb2.PrefillRequest(
        request=worker_pb2.EngineRequest(request_id="abc", prompt_ids=[1, 2, 3]), generation=1
    ).SerializeToString()
    garbage = b"\xff\xff\xff\xff"
    cases = [
        ([garbage], "request"),
        ([first.replace(b"abc", b"a\xffc")], "request.request_id"),
        ([first, garbage], "request"),  # the second message, the target's, is corrupt
    ]
    for messages, field in cases:
        with pytest.raises(grpc.RpcError) as failed:
            _ahead_raw(prefill)(iter(messages), timeout=10)
        assert failed.value.code() == grpc.StatusCode.INVALID_ARGUMENT, messages
        assert wire.field_of(failed.value) == field, messages
    wait_until(lambda: prefill.free_blocks() == NUM_BLOCKS, 3.0, "prefill blocks freed")


def test_a_prefill_ahead_whose_first_message_never_comes_ends_at_the_workers_bound(
    pair: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A PrefillAhead without a deadline that never sends its first message ends at the
    worker's transfer bound, DEADLINE_EXCEEDED naming `request` (it held a drain forever)."""
    prefill, _ = pair
    monkeypatch.setattr(prefill.role.servicer, "transfer_timeout", 1.0)
    never = threading.Event()

    def nothing() -> Iterator[bytes]:
        never.wait(30)
        yield from ()

    call = _ahead_raw(prefill).future(nothing())
    try:
        with pytest.raises(grpc.RpcError) as failed:
            call.result(timeout=5)
        assert failed.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert (failed.value.details() or "").startswith("request:")
    finally:
        never.set()
        call.cancel()
