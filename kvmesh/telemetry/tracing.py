"""OpenTelemetry tracing configured once per process from the standard environment variables.

Honoured variables (read once, at `setup_tracing`):
- `OTEL_SDK_DISABLED=true`: no tracing at all.
- `OTEL_TRACES_EXPORTER`: `otlp` (gRPC OTLP; the exporter reads `OTEL_EXPORTER_OTLP_*`),
  `console`, or `none`. Default: `otlp` when `OTEL_EXPORTER_OTLP_ENDPOINT` or
  `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` is set, else `none`.
- `OTEL_SERVICE_NAME`, `OTEL_RESOURCE_ATTRIBUTES`: the resource (via `Resource.create`).
With exporter `none` a real SDK tracer provider still runs (spans get ids, so trace context
propagates through the services and appears in logs) but nothing is exported.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from opentelemetry import trace
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    ConsoleSpanExporter,
    SimpleSpanProcessor,
    SpanExporter,
)

EXPORTERS = ("otlp", "console", "none")


class TracingConfigError(ValueError):
    """An OTEL_* variable has a value kvmesh cannot use."""


@dataclass(frozen=True)
class TracingConfig:
    disabled: bool
    exporter: str
    service_name: str

    @classmethod
    def from_env(cls, default_service: str, env: Mapping[str, str] | None = None) -> TracingConfig:
        env = os.environ if env is None else env
        endpoints = ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
        has_endpoint = any(env.get(k) for k in endpoints)
        exporter = env.get("OTEL_TRACES_EXPORTER", "otlp" if has_endpoint else "none").lower()
        if exporter not in EXPORTERS:
            raise TracingConfigError(
                f"OTEL_TRACES_EXPORTER={exporter!r} is not supported; use one of {EXPORTERS}"
            )
        return cls(
            disabled=env.get("OTEL_SDK_DISABLED", "").lower() == "true",
            exporter=exporter,
            service_name=env.get("OTEL_SERVICE_NAME", default_service),
        )


def _exporter(name: str) -> SpanExporter | None:
    if name == "console":
        return ConsoleSpanExporter()
    if name == "otlp":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        return OTLPSpanExporter()
    return None


def setup_tracing(default_service: str) -> TracerProvider | None:
    """Install a global tracer provider for this process; returns it (None when disabled).

    Call once at process start, before serving. Shut it down with `provider.shutdown()` to flush.
    """
    config = TracingConfig.from_env(default_service)
    if config.disabled:
        return None
    resource = Resource.create({SERVICE_NAME: config.service_name})
    provider = TracerProvider(resource=resource)
    exporter = _exporter(config.exporter)
    if exporter is not None:
        processor = (
            SimpleSpanProcessor(exporter)
            if config.exporter == "console"
            else BatchSpanProcessor(exporter)
        )
        provider.add_span_processor(processor)
    trace.set_tracer_provider(provider)
    return provider


def tracer(name: str) -> trace.Tracer:
    """The tracer for a kvmesh component (a no-op tracer until `setup_tracing` ran)."""
    return trace.get_tracer(name)
