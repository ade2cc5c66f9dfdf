"""Disaggregated failure paths: cancel, lease expiry, fencing, bad input — blocks always freed."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import grpc
import pytest
from svc_harness import NUM_BLOCKS, engine_config, start_worker, svc_loop, svc_model_dir, wait_until
from test_svc_disagg import ControlDriver, backends_here

from decode_svc.main import install as install_decode
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
    assert next(stream).token_ids == [response.first_tokens[0].token_id]
    next(stream)
    assert driver.decode.free_blocks() < NUM_BLOCKS
    stream.cancel()
    wait_until(lambda: all_free(driver), 1.0, "decode blocks freed after cancel")


def test_reservation_lease_expiry_frees_blocks(driver: ControlDriver) -> None:
    leases = driver.decode.role.servicer.metrics.reservation_leases
    granted, expired = (leases.labels(e)._value.get() for e in ("granted", "expired"))
    request = driver.prepare("lease", list(range(1, 40)), max_tokens=4)
    driver.reserve(request, generation=1, lease=0.3)
    assert driver.decode.free_blocks() == NUM_BLOCKS - 3
    wait_until(lambda: all_free(driver), 2.0, "reservation reclaimed by its lease")
    wait_until(lambda: leases.labels("expired")._value.get() == expired + 1, 1.0, "counted")
    assert leases.labels("granted")._value.get() == granted + 1


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
