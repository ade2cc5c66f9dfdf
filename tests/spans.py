"""Spans of the test process, for tests that read what was traced.

Import as `from tests.spans import in_memory_spans` (the repository root is on the test path)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter


@contextlib.contextmanager
def in_memory_spans() -> Iterator[InMemorySpanExporter]:
    """Every span this process ends while the context is open (an SDK provider is installed
    when none is); later spans are dropped."""
    provider = trace.get_tracer_provider()
    if not isinstance(provider, TracerProvider):
        provider = TracerProvider()
        trace.set_tracer_provider(provider)
    memory = InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(memory))
    yield memory
    memory.shutdown()
