"""Prometheus metrics of one kvmesh worker, served as text on a per-worker HTTP port.

Engine metrics carry vLLM's names under a `kvmesh:` prefix and a `model_name` label, so
dashboards built for `vllm:*` port by renaming the prefix. Request-level metrics (TTFT, ITL,
token counters, end-to-end) are the control plane's (`control_plane/metrics.py`): in a
disaggregated system no single worker sees a whole request. The rest follow Prometheus
conventions (`kvmesh_` prefix, base units, `_total` counters); status labels are gRPC code
names (`OK`, `INVALID_ARGUMENT`, ...). Each role registers only the families it records.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import grpc
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvmesh.telemetry.metrics_http import start_metrics_server

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
ROLES = ("prefill", "decode", "colocated")


def status_name(code: grpc.StatusCode) -> str:
    """The label value of a status: its gRPC code name (`OK`, `INVALID_ARGUMENT`, ...)."""
    return code.name


class EngineCollector(Collector):
    """vLLM's engine families, read from the engine's load snapshot at every scrape.

    `load()` returns an object with total_blocks, free_blocks, running, waiting,
    prefix_query_tokens, prefix_hit_tokens and preemptions (cumulative counts). Without
    `prefix_cache` (a decode worker: its prompts arrive as KV, never looked up) the two
    prefix-cache families are left out."""

    def __init__(self, load: Callable[[], Any], model_name: str, prefix_cache: bool) -> None:
        self.load = load
        self.model_name = model_name
        self.prefix_cache = prefix_cache

    def collect(self) -> Iterator[Metric]:
        load, labels = self.load(), [self.model_name]
        usage = 0.0
        if load.total_blocks:
            usage = (load.total_blocks - load.free_blocks) / load.total_blocks
        gauges = (
            ("kvmesh:num_requests_running", "Sequences in the running batch.", load.running),
            ("kvmesh:num_requests_waiting", "Sequences waiting to be scheduled.", load.waiting),
            ("kvmesh:kv_cache_usage_perc", "Fraction of KV blocks in use (0-1).", usage),
        )
        for name, doc, value in gauges:
            gauge = GaugeMetricFamily(name, doc, labels=["model_name"])
            gauge.add_metric(labels, value)
            yield gauge
        counters = [
            ("kvmesh:num_preemptions", "Sequences preempted (recomputed later) for KV blocks.",
             load.preemptions),
        ]  # fmt: skip
        if self.prefix_cache:
            counters += [
                ("kvmesh:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                 load.prefix_query_tokens),
                ("kvmesh:prefix_cache_hits", "Prompt tokens served from the prefix cache.",
                 load.prefix_hit_tokens),
            ]  # fmt: skip
        for name, doc, value in counters:
            counter = CounterMetricFamily(name, doc, labels=["model_name"])
            counter.add_metric(labels, value)
            yield counter


class WorkerMetrics:
    """The metric families of one worker process of `role` (prefill, decode or colocated)."""

    def __init__(self, role: str = "colocated", registry: CollectorRegistry | None = None):
        if role not in ROLES:
            raise ValueError(f"role: {role!r} is not one of {ROLES}")
        self.role = role
        self.registry = r = registry or CollectorRegistry()
        self.requests = Counter(
            "kvmesh_requests_total",
            "Calls to this worker's request path finished, by gRPC status.",
            ["status"],
            registry=r,
        )
        self.auth_refused = Counter(
            "kvmesh_auth_refused_total",
            "Calls to this worker refused for a missing or wrong cluster token.",
            registry=r,
        )
        self.blocks = Gauge(
            "kvmesh_kv_blocks",
            "KV blocks: used (held by requests) and free (the rest) partition the pool; cached "
            "counts the free blocks that still hold a reusable prefix.",
            ["state"],
            registry=r,
        )
        if role == "prefill":
            self._transfer_families(r)
        if role == "decode":
            self.reservation_leases = Counter(
                "kvmesh_reservation_leases_total",
                "Decode reservation leases, by event (granted, expired).",
                ["event"],
                registry=r,
            )

    def _transfer_families(self, r: CollectorRegistry) -> None:
        self.transfer_seconds = Histogram(
            "kvmesh_kv_transfer_seconds",
            "Duration of one KV block-set transfer, by backend and gRPC status (failures: "
            'status!="OK").',
            ["backend", "status"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.transfer_bytes = Counter(
            "kvmesh_kv_transfer_bytes_total",
            "KV bytes acknowledged by the receiver, by backend.",
            ["backend"],
            registry=r,
        )

    def bind_engine(self, load: Callable[[], Any], model_name: str) -> Callable[[int], None]:
        """Register the engine families read from `load()`; returns the per-step observer
        of `kvmesh:iteration_tokens_total` (tokens scheduled in one engine step)."""
        self.registry.register(EngineCollector(load, model_name, self.role != "decode"))
        histogram = Histogram(
            "kvmesh:iteration_tokens_total",
            "Tokens scheduled per engine step (prefill chunks and decode tokens together).",
            ["model_name"],
            buckets=ITERATION_TOKEN_BUCKETS,
            registry=self.registry,
        )
        return histogram.labels(model_name).observe

    def request_done(self, code: grpc.StatusCode) -> None:
        """Count one finished call of the request path under its gRPC status."""
        self.requests.labels(status_name(code)).inc()


def serve_metrics(metrics: WorkerMetrics, port: int, addr: str = "127.0.0.1") -> int:
    """Serve `metrics` as Prometheus text on http://addr:port/metrics; port 0 picks a free one.

    Returns the bound port.
    """
    return int(start_metrics_server(metrics.registry, port, addr).server_port)
