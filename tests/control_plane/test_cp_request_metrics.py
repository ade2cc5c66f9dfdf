"""The front door's request-level metrics over real gRPC (fake workers): latencies end at the
last token relayed, never at the cleanup that follows it (the Releases, however slow)."""

from __future__ import annotations

import asyncio
import urllib.request

import grpc
import pytest
from cp_harness import control_plane, run_async, status_of, text_request
from prometheus_client.parser import text_string_to_metric_families

RELEASE_SECONDS = 0.5


@run_async
async def test_e2e_and_decode_time_end_at_the_last_token_not_after_the_releases() -> None:
    async with control_plane() as cp:
        await cp.add("p0", "prefill")
        decode = await cp.add("d0", "decode")
        decode.release_delay = RELEASE_SECONDS  # a busy worker answers its Release late
        call = cp.generation.Generate(text_request("hi", request_id="slow-release"), timeout=5)
        code, _, responses = await status_of(call)
        assert code == grpc.StatusCode.OK
        assert "Release" in decode.calls
        usage = responses[-1].usage  # e2e as of the last token, as the client saw it
        registry = cp.server.cluster.metrics.registry

        def observed(name: str) -> float:
            value = registry.get_sample_value(name + "_sum", {"model_name": "tiny"})
            assert value is not None, name
            return value

        e2e = observed("kvmesh:e2e_request_latency_seconds")
        assert e2e == pytest.approx(usage.e2e_seconds, abs=RELEASE_SECONDS / 5)
        decode_time = observed("kvmesh:request_decode_time_seconds")
        expected = usage.e2e_seconds - usage.ttft_seconds
        assert decode_time == pytest.approx(expected, abs=RELEASE_SECONDS / 5)


@run_async
async def test_a_request_keeps_the_model_it_was_admitted_for_when_every_worker_dies() -> None:
    """A run whose only worker dies mid-stream is counted under the model it was admitted for
    (its span's), not under "" because no worker is live when it finishes."""
    async with control_plane(lease_seconds=0.4, heartbeat_interval_seconds=0.1,
                             reap_interval_seconds=0.05) as cp:  # fmt: skip
        worker = await cp.add("c0", "colocated")  # never heartbeats: reaped after its lease
        worker.after_first_gate = asyncio.Event()  # one token streamed, then silence
        call = cp.generation.Generate(text_request("hi", request_id="orphan"), timeout=5)
        code, _, responses = await status_of(call)
        assert code == grpc.StatusCode.UNAVAILABLE and len(responses) == 1
        registry = cp.server.cluster.metrics.registry
        tokens = "kvmesh:generation_tokens_total"
        assert registry.get_sample_value(tokens, {"model_name": "tiny"}) == 1
        assert registry.get_sample_value(tokens, {"model_name": ""}) is None


@run_async
async def test_a_request_refused_while_no_worker_is_live_adds_no_empty_model_series() -> None:
    """No worker registered (an outage): the refused request is counted by status, and no
    model-labelled family gets a `model_name=""` series (in a scrape of /metrics)."""
    async with control_plane(metrics_port=0) as cp:
        code, _, _ = await status_of(cp.generation.Generate(text_request("hi"), timeout=5))
        assert code == grpc.StatusCode.UNAVAILABLE
        url = f"http://{cp.server.metrics_address}/metrics"
        text = await asyncio.to_thread(lambda: urllib.request.urlopen(url, timeout=5).read())
    samples = [s for f in text_string_to_metric_families(text.decode()) for s in f.samples]
    refused = [s for s in samples if s.name == "kvmesh_control_requests_total"]
    assert [(s.labels, s.value) for s in refused] == [({"status": "UNAVAILABLE"}, 1.0)]
    unnamed = [s.name for s in samples if s.labels.get("model_name") == ""]
    assert not unnamed, unnamed
