"""Tracing configuration from OTEL_* variables and the Prometheus text endpoint."""

from __future__ import annotations

import urllib.request

import pytest

from kvmesh.telemetry.metrics import WorkerMetrics, serve_metrics
from kvmesh.telemetry.tracing import TracingConfig, TracingConfigError


def test_exporter_defaults_to_none_without_endpoint() -> None:
    config = TracingConfig.from_env("kvmesh-decode", env={})
    assert (config.exporter, config.service_name, config.disabled) == (
        "none",
        "kvmesh-decode",
        False,
    )


def test_endpoint_selects_otlp_and_service_name_overrides() -> None:
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4317", "OTEL_SERVICE_NAME": "x"}
    config = TracingConfig.from_env("kvmesh-decode", env=env)
    assert (config.exporter, config.service_name) == ("otlp", "x")


def test_unknown_exporter_names_the_variable() -> None:
    with pytest.raises(TracingConfigError, match="OTEL_TRACES_EXPORTER"):
        TracingConfig.from_env("kvmesh", env={"OTEL_TRACES_EXPORTER": "zipkin"})


def test_metrics_endpoint_serves_recorded_values() -> None:
    metrics = WorkerMetrics("prefill")
    metrics.transfer_seconds.labels(backend="shm", status="OK").observe(0.02)
    metrics.blocks.labels(state="free").set(17)
    port = serve_metrics(metrics, 0)
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    assert 'kvmesh_kv_transfer_seconds_count{backend="shm",status="OK"} 1.0' in body
    assert 'kvmesh_kv_blocks{state="free"} 17.0' in body


def test_otlp_protocol_picks_the_grpc_or_http_exporter() -> None:
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as Grpc
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as Http
    from opentelemetry.sdk.trace.export import ConsoleSpanExporter as Console

    from kvmesh.telemetry.tracing import _exporters

    def chosen(**env: str) -> list[type]:
        config = TracingConfig.from_env("k", env={"OTEL_TRACES_EXPORTER": "otlp", **env})
        return [type(exporter) for exporter in _exporters(config)]

    assert chosen() == [Grpc]
    assert chosen(OTEL_EXPORTER_OTLP_PROTOCOL="grpc") == [Grpc]
    assert chosen(OTEL_EXPORTER_OTLP_PROTOCOL="http/protobuf") == [Http]
    assert chosen(
        OTEL_EXPORTER_OTLP_PROTOCOL="grpc", OTEL_EXPORTER_OTLP_TRACES_PROTOCOL="http/protobuf"
    ) == [Http]
    assert chosen(OTEL_TRACES_EXPORTER="otlp_proto_http, console") == [Http, Console]
    assert chosen(OTEL_TRACES_EXPORTER="none") == []


def test_unknown_protocol_names_the_variable() -> None:
    with pytest.raises(TracingConfigError, match="OTEL_EXPORTER_OTLP_PROTOCOL"):
        TracingConfig.from_env("k", env={"OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"})


def test_health_checks_and_heartbeats_are_not_traced() -> None:
    import grpc
    from opentelemetry import trace

    from kvmesh.telemetry.tracing import TracedCalls, _traced

    def call(method: str) -> grpc.aio.ClientCallDetails:
        return grpc.aio.ClientCallDetails(method.encode(), None, None, None, None)

    traced = _traced()
    assert not traced(call("/grpc.health.v1.Health/Check"))
    assert not traced(call("/kvmesh.v1.ControlService/Heartbeat"))
    assert traced(call("/kvmesh.v1.ControlService/Register"))
    assert traced(call("/kvmesh.v1.DecodeService/Decode"))
    # the client side (CLIENT spans) skips the same methods
    client = TracedCalls(trace.get_tracer("test"))
    assert not client.traces(call("/grpc.health.v1.Health/Check"))
    assert not client.traces(call("/kvmesh.v1.ControlService/Heartbeat"))
    assert client.traces(call("/kvmesh.v1.ControlService/Register"))


def test_each_role_registers_only_what_it_records() -> None:
    def families(role: str) -> set[str]:
        return {m.name for m in WorkerMetrics(role).registry.collect()}

    assert "kvmesh_kv_transfer_seconds" in families("prefill")
    assert "kvmesh_kv_transfer_seconds" not in families("decode") | families("colocated")
    assert "kvmesh_reservation_leases" in families("decode") - families("prefill")
    with pytest.raises(ValueError, match="role"):
        WorkerMetrics("router")
