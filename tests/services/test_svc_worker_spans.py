"""A prefill worker's spans over real gRPC (real engines, a real in-memory exporter): the KV
transfer's own span, a child of the Prefill call's SERVER span, and on failure its status
ERROR with `error.type` the transfer's end state (OBSERVABILITY.md "Tracing")."""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from svc_harness import NUM_BLOCKS, engine_config, start_worker, svc_loop, svc_model_dir, wait_until
from test_svc_disagg import ControlDriver, backends_here

from decode_svc.main import install as install_decode
from kvmesh.v1 import worker_pb2
from prefill_svc.main import install as install_prefill
from tests.spans import in_memory_spans

__all__ = ["svc_loop", "svc_model_dir"]


@pytest.fixture(scope="module")
def exporter() -> Iterator[InMemorySpanExporter]:
    with in_memory_spans() as memory:
        yield memory


@pytest.fixture(scope="module")
def driver(svc_loop: Any, svc_model_dir: Path, exporter: InMemorySpanExporter) -> Any:
    args = argparse.Namespace(transfer_backend=backends_here()[:1])
    config = engine_config(svc_model_dir)
    prefill = start_worker(svc_loop, config, "prefill", install_prefill, args)
    decode = start_worker(svc_loop, config, "decode", install_decode, args)
    yield ControlDriver(prefill, decode, backends_here()[0])
    prefill.stop()
    decode.stop()


def test_a_refused_transfer_span_names_its_end_state(
    driver: ControlDriver, exporter: InMemorySpanExporter
) -> None:
    """Frames of a stale generation are refused by the receiver: the transfer span, child of
    the Prefill span, is ERROR with `error.type` its end state, as `kvmesh.transfer.state`."""
    request = driver.prepare("span-stale", list(range(1, 20)), max_tokens=4)
    reservation = driver.reserve(request, generation=7)
    exporter.clear()
    with pytest.raises(grpc.RpcError) as refused:
        driver.prefill(request, driver.target(reservation, 6))
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    names = (f"kv_transfer {driver.backend}", "/kvmesh.v1.PrefillService/Prefill")

    def ended() -> dict[str, Any]:
        return {span.name: span for span in exporter.get_finished_spans() if span.name in names}

    wait_until(lambda: len(ended()) == 2, 2.0, "both spans ended")  # the status may come first
    transfer, prefill = (ended()[name] for name in names)
    assert transfer.parent is not None
    assert transfer.parent.span_id == prefill.context.span_id
    assert prefill.attributes is not None and transfer.attributes is not None
    assert prefill.attributes["kvmesh.request_id"] == "span-stale"
    assert transfer.status.status_code is trace.StatusCode.ERROR
    state = transfer.attributes["kvmesh.transfer.state"]
    assert state != "COMPLETED"
    assert transfer.attributes["error.type"] == state
    driver.d.Release(worker_pb2.ReleaseRequest(request_id="span-stale", generation=7), timeout=5)
    wait_until(lambda: driver.decode.free_blocks() == NUM_BLOCKS, 2.0, "decode blocks freed")
