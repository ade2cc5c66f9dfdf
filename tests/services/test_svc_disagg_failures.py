"""Disaggregated failure paths: cancel, lease expiry, fencing, bad input — blocks always freed."""

from __future__ import annotations

import argparse
import logging
import threading
import time
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from svc_harness import NUM_BLOCKS, engine_config, start_worker, svc_loop, svc_model_dir, wait_until
from test_svc_disagg import ControlDriver, backends_here

from decode_svc.main import install as install_decode
from kv_transfer.header import MsgType, frame_header
from kv_transfer.receiver_core import WINDOW_GRACE_SECONDS
from kvmesh.telemetry.logs import current_request_id
from kvmesh.v1 import worker_pb2
from prefill_svc.main import install as install_prefill

__all__ = ["svc_loop", "svc_model_dir"]


@pytest.fixture(scope="module")
def driver(svc_loop: Any, svc_model_dir: Path) -> Any:
    args = argparse.Namespace(transfer_backend=backends_here()[:1])
    config = engine_config(svc_model_dir)
    prefill = start_worker(svc_loop, config, "prefill", install_prefill, args)
    decode = start_worker(svc_loop, config, "decode", install_decode, args)
    yield ControlDriver(prefill, decode, backends_here()[0])
    prefill.stop()
    decode.stop()


def all_free(driver: ControlDriver) -> bool:
    return driver.decode.free_blocks() == NUM_BLOCKS and not driver.decode.role.held()


def test_decode_cancelled_mid_stream_frees_blocks_within_a_second(driver: ControlDriver) -> None:
    # The longest the model takes (16 + 240 = max_model_len): decoding outlasts the checks.
    request = driver.prepare("cancel", list(range(10, 26)), max_tokens=240, ignore_eos=True)
    reservation = driver.reserve(request, generation=3)
    stream = driver.decode_call("cancel", reservation, 3)
    response = driver.prefill(request, driver.target(reservation, 3))
    # the first response starts with the prefill's token (later steps' merge in while unread)
    assert next(stream).token_ids[0] == response.first_tokens[0].token_id
    next(stream)
    assert driver.decode.free_blocks() < NUM_BLOCKS
    stream.cancel()
    wait_until(lambda: all_free(driver), 1.0, "decode blocks freed after cancel")


class RequestIds(logging.Handler):
    """The request id in scope (the structured logs' `request_id` field) of each message."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: dict[str, str | None] = {}

    def emit(self, record: logging.LogRecord) -> None:
        self.seen[record.getMessage()] = current_request_id()


def test_reservation_lease_expiry_frees_blocks(driver: ControlDriver) -> None:
    leases = driver.decode.role.servicer.metrics.reservation_leases
    granted, expired = (leases.labels(e)._value.get() for e in ("granted", "expired"))
    logs, logger = RequestIds(), logging.getLogger("kvmesh.decode")
    logger.addHandler(logs)
    level = logger.level
    logger.setLevel(logging.INFO)
    try:
        request = driver.prepare("lease", list(range(1, 40)), max_tokens=4)
        driver.reserve(request, generation=1, lease=0.3)
        assert driver.decode.free_blocks() == NUM_BLOCKS - 3
        wait_until(lambda: all_free(driver), 2.0, "reservation reclaimed by its lease")
        wait_until(lambda: leases.labels("expired")._value.get() == expired + 1, 1.0, "counted")
    finally:
        logger.removeHandler(logs)
        logger.setLevel(level)
    assert leases.labels("granted")._value.get() == granted + 1
    assert logs.seen["reservation of lease expired"] == "lease"  # the line's request_id


def test_decode_waiting_for_kv_that_never_comes_ends_with_its_lease(
    driver: ControlDriver,
) -> None:
    # The Decode call's own deadline (30 s) is far off: only the lease can end the wait.
    request = driver.prepare("no-kv", list(range(1, 40)), max_tokens=4)
    reservation = driver.reserve(request, generation=2, lease=0.5)
    stream = driver.decode_call("no-kv", reservation, 2)
    with pytest.raises(grpc.RpcError) as caught:
        next(stream)
    assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert "transfer_id" in caught.value.details()
    wait_until(lambda: all_free(driver), 1.0, "expired reservation freed")


def test_stale_generation_epoch_and_transfer_are_refused(driver: ControlDriver) -> None:
    request = driver.prepare("fenced", list(range(1, 20)), max_tokens=4, temperature=0.0)
    reservation = driver.reserve(request, generation=7)
    with pytest.raises(grpc.RpcError) as stale_reserve:
        driver.reserve(request, generation=6)
    assert stale_reserve.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert (stale_reserve.value.details() or "").startswith("generation")
    registry = driver.prefill_worker.role.servicer.metrics.registry
    code = {"status": "FAILED_PRECONDITION"}

    def failures() -> tuple[float | None, float | None]:
        transfers = registry.get_sample_value(
            "kvmesh_kv_transfer_seconds_count", {"backend": driver.backend, **code}
        )
        return transfers, registry.get_sample_value("kvmesh_requests_total", code)

    before = failures()
    with pytest.raises(grpc.RpcError) as stale_transfer:  # frames carry generation 6: refused
        driver.prefill(request, driver.target(reservation, 6))
    assert stale_transfer.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert failures() == ((before[0] or 0) + 1, (before[1] or 0) + 1)
    wait_until(lambda: driver.prefill_worker.free_blocks() == NUM_BLOCKS, 1.0, "prefill freed")
    for field, change in (("epoch", {"epoch": 12345}), ("generation", {"generation": 6})):
        call = driver.d.Decode(decode_request(reservation, **change), timeout=5)
        with pytest.raises(grpc.RpcError) as refused:
            list(call)
        assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert (refused.value.details() or "").startswith(field)
    from kvmesh.v1 import worker_pb2

    release = worker_pb2.ReleaseRequest(request_id="fenced", generation=6)
    assert not driver.d.Release(release, timeout=5).released
    release.generation = 7
    assert driver.d.Release(release, timeout=5).released
    assert not driver.d.Release(release, timeout=5).released  # idempotent
    wait_until(lambda: all_free(driver), 1.0, "released reservation freed")


def decode_request(reservation: Any, **change: Any) -> Any:
    from kvmesh.v1 import worker_pb2

    fields: dict[str, Any] = {
        "request_id": "fenced",
        "epoch": reservation.epoch,
        "generation": 7,
        "transfer_id": reservation.transfer_id,
    }
    fields.update(change)
    return worker_pb2.DecodeRequest(**fields)


BAD = [
    ("prompt", [], {}),
    ("prompt.token_ids", [1, 99999], {}),
    ("prompt", list(range(1, 300)), {}),
    ("max_tokens", [1, 2], {"max_tokens": 0}),
    ("temperature", [1, 2], {"temperature": float("nan")}),
    ("stop", [1, 2], {"stop": ["s"] * 17}),
    ("stop", [1, 2], {"stop": ["s" * 300]}),
]


@pytest.mark.parametrize(("field", "ids", "sampling"), BAD, ids=[f"{b[0]}-{i}" for i, b in
                                                                  enumerate(BAD)])  # fmt: skip
def test_prepare_rejects_bad_input_naming_the_field(
    driver: ControlDriver, field: str, ids: list[int], sampling: dict[str, Any]
) -> None:
    with pytest.raises(grpc.RpcError) as info:
        driver.prepare(f"bad-{field}", ids, **sampling)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert (info.value.details() or "").startswith(field), info.value.details()
    assert all_free(driver)


def test_reserve_beyond_free_blocks_is_resource_exhausted(driver: ControlDriver) -> None:
    held = []
    for i in range(3):  # 3 x 15 blocks of the 48
        request = driver.prepare(f"big-{i}", list(range(1, 241)), max_tokens=4)
        held.append(driver.reserve(request, generation=1))
    request = driver.prepare("one-too-many", list(range(1, 241)), max_tokens=4)
    with pytest.raises(grpc.RpcError) as info:
        driver.reserve(request, generation=1)
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    from kvmesh.v1 import worker_pb2

    for i in range(3):
        driver.d.Release(worker_pb2.ReleaseRequest(request_id=f"big-{i}"), timeout=5)
    wait_until(lambda: all_free(driver), 1.0, "released reservations freed")


def _grant(driver: ControlDriver, reservation: Any, generation: int) -> bytes:
    """What a registered-memory sender's BEGIN does: a write window over the reserved blocks
    is granted to it (the receiver's core, as its connection thread calls it)."""
    core = next(iter(driver.decode.role.table.receivers.values())).core
    tid = bytes.fromhex(reservation.transfer_id)
    payload = np.asarray(reservation.block_ids, dtype=np.int32).tobytes()
    core.grant(frame_header(MsgType.BEGIN, tid, generation, payload), payload)
    return tid


def test_released_blocks_a_sender_may_write_stay_out_of_the_pool_until_it_stops(
    driver: ControlDriver,
) -> None:
    """A reservation released while a sender holds a write window into its blocks (a cancel
    only asks it to stop) keeps its prompt blocks out of the pool until the sender is known
    to have stopped; then they all come back."""
    request = driver.prepare("fence", list(range(1, 40)), max_tokens=4)
    reservation = driver.reserve(request, generation=4)
    tid = _grant(driver, reservation, 4)
    release = worker_pb2.ReleaseRequest(request_id="fence", generation=4)
    assert driver.d.Release(release, timeout=10).released
    table = driver.decode.role.table
    assert table.fenced == 1 and not driver.decode.role.held()
    time.sleep(0.3)  # long enough for the engine to have freed them, were they not fenced
    assert driver.decode.free_blocks() == NUM_BLOCKS - len(reservation.block_ids)
    next(iter(table.receivers.values())).core.window_closed(tid)  # the sender's CANCEL
    wait_until(lambda: all_free(driver) and table.fenced == 0, 1.0, "blocks back once stopped")


def test_a_fenced_reservation_comes_back_after_its_lease_and_the_grace(
    driver: ControlDriver,
) -> None:
    """A sender that never says it stopped: its window closes at the lease plus the grace
    (it never starts a copy after its grant's lease), and the blocks come back then."""
    request = driver.prepare("lapse", list(range(1, 40)), max_tokens=4)
    reservation = driver.reserve(request, generation=5, lease=0.3)
    _grant(driver, reservation, 5)
    wait_until(lambda: driver.decode.role.table.fenced == 1, 1.0, "expired and fenced")
    assert driver.decode.free_blocks() < NUM_BLOCKS
    wait_until(lambda: all_free(driver), WINDOW_GRACE_SECONDS + 1.5, "back after the grace")


def test_a_newer_generation_supersedes_an_open_decode_call(driver: ControlDriver) -> None:
    """Reserve under a newer generation while the older one decodes: the old Decode call ends
    at once with ABORTED naming the supersession, and the new generation is prefilled and
    decoded in full under the same request id."""
    request = driver.prepare("sup", list(range(10, 26)), max_tokens=64, ignore_eos=True)
    first = driver.reserve(request, generation=3)
    old = driver.decode_call("sup", first, 3)
    driver.prefill(request, driver.target(first, 3))
    next(old)  # the old generation is decoding
    second = driver.reserve(request, generation=4)
    with pytest.raises(grpc.RpcError) as ended:
        list(old)
    assert ended.value.code() == grpc.StatusCode.ABORTED
    assert "superseded by generation 4" in (ended.value.details() or "")
    new = driver.decode_call("sup", second, 4)
    driver.prefill(request, driver.target(second, 4))
    assert sum(len(response.token_ids) for response in new) == 64
    wait_until(lambda: all_free(driver), 1.0, "every block freed")


def test_a_refused_newer_reserve_leaves_the_held_generation(driver: ControlDriver) -> None:
    """A Reserve under a newer generation with a bad lease is refused (INVALID_ARGUMENT naming
    lease_seconds) before it supersedes anything: the older generation's reservation and its
    open Decode call are untouched, and finish."""
    request = driver.prepare("keep", list(range(10, 26)), max_tokens=8, ignore_eos=True)
    first = driver.reserve(request, generation=3)
    old = driver.decode_call("keep", first, 3)
    for lease in (-1.0, float("nan")):
        with pytest.raises(grpc.RpcError) as refused:
            driver.reserve(request, generation=4, lease=lease)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "lease_seconds" in (refused.value.details() or "")
    driver.prefill(request, driver.target(first, 3))
    assert sum(len(response.token_ids) for response in old) == 8
    wait_until(lambda: all_free(driver), 1.0, "every block freed")


def test_a_sender_connected_after_its_call_was_released_goes_back_to_the_pool(
    driver: ControlDriver, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A Prefill released while its sender still connects (a slow handshake) ends ABORTED at
    once, and the sender that connects afterwards is pooled for the next transfer, not
    dropped unclosed."""
    pool = driver.prefill_worker.role.senders
    request = driver.prepare("late", list(range(10, 40)), max_tokens=4)
    reservation = driver.reserve(request, generation=5)
    target = driver.target(reservation, 5)
    while (idle := pool.take_idle(target.backend, target.endpoint)) is not None:
        idle.close()  # the call must connect a new one
    connecting, made = threading.Event(), []
    connect = pool.acquire

    def slow(backend: str, endpoint: str, deadline: float | None = None) -> Any:
        connecting.set()
        time.sleep(1.0)
        made.append(connect(backend, endpoint, deadline))
        return made[-1]

    monkeypatch.setattr(pool, "acquire", slow)
    call = driver.p.Prefill.future(
        worker_pb2.PrefillRequest(request=request, target=target), timeout=30
    )
    assert connecting.wait(5)
    release = worker_pb2.ReleaseRequest(request_id="late", generation=5)
    assert driver.p.Release(release, timeout=5).released
    with pytest.raises(grpc.RpcError) as ended:
        call.result(timeout=5)
    assert ended.value.code() == grpc.StatusCode.ABORTED
    wait_until(lambda: bool(made) and made[0] in pool.idle(target.backend), 5.0, "pooled")
    driver.d.Release(release, timeout=5)
    wait_until(lambda: driver.decode.free_blocks() == NUM_BLOCKS, 2.0, "decode freed")


def test_a_cancelled_decode_keeps_blocks_fenced_while_a_sender_holds_a_window(
    driver: ControlDriver,
) -> None:
    """A Decode call cancelled while it waits for the KV (client gone, deadline, abort) with a
    registered-memory sender still holding a write window: the prompt blocks stay out of the
    pool until the sender stopped, as for a Release."""
    request = driver.prepare("cfence", list(range(1, 40)), max_tokens=4)
    reservation = driver.reserve(request, generation=6)
    tid = _grant(driver, reservation, 6)
    table = driver.decode.role.table
    call = driver.decode_call("cfence", reservation, 6)  # waits for the KV
    wait_until(
        lambda: (held := table.get("cfence")) is not None and held.decoding,
        5.0,
        "Decode claimed the reservation",
    )
    call.cancel()
    wait_until(lambda: table.get("cfence") is None, 2.0, "reservation dropped")
    time.sleep(0.3)  # long enough for the engine to have freed them, were they not fenced
    assert table.fenced == 1
    assert driver.decode.free_blocks() == NUM_BLOCKS - len(reservation.block_ids)
    next(iter(table.receivers.values())).core.window_closed(tid)  # the sender's CANCEL
    wait_until(lambda: all_free(driver) and table.fenced == 0, 2.0, "blocks back once stopped")
