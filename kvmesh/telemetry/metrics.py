"""Prometheus metrics shared by kvmesh workers, served as text on a per-worker HTTP port.

Names follow Prometheus conventions (`kvmesh_` prefix, base units, `_total` counters). Every
process registers the same families in its own registry; `serve_metrics(port)` exposes it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
TOKEN_LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)


def _histogram(name: str, doc: str, registry: CollectorRegistry, **kw: object) -> Histogram:
    return Histogram(name, doc, registry=registry, **kw)  # type: ignore[arg-type]


@dataclass
class WorkerMetrics:
    """The metric families of one worker process (prefill, decode or colocated)."""

    registry: CollectorRegistry = field(default_factory=CollectorRegistry)

    def __post_init__(self) -> None:
        r = self.registry
        self.requests = Counter(
            "kvmesh_requests_total", "Requests finished, by final status.", ["status"], registry=r
        )
        self.ttft = _histogram(
            "kvmesh_time_to_first_token_seconds",
            "Time from arrival to the first token, including queue, prefill and KV transfer.",
            r,
            buckets=LATENCY_BUCKETS,
        )
        self.ttft_phase = _histogram(
            "kvmesh_ttft_phase_seconds",
            "Time to first token split by phase (queue, prefill, transfer, first_decode).",
            r,
            labelnames=["phase"],
            buckets=LATENCY_BUCKETS,
        )
        self.inter_token = _histogram(
            "kvmesh_inter_token_latency_seconds",
            "Time between consecutive tokens of one sequence.",
            r,
            buckets=TOKEN_LATENCY_BUCKETS,
        )
        self.transfer_seconds = _histogram(
            "kvmesh_kv_transfer_seconds",
            "Duration of one KV block-set transfer, by backend and outcome.",
            r,
            labelnames=["backend", "outcome"],
            buckets=LATENCY_BUCKETS,
        )
        self.transfer_bytes = Counter(
            "kvmesh_kv_transfer_bytes_total", "KV bytes moved, by backend.", ["backend"], registry=r
        )
        self.lease_expiries = Counter(
            "kvmesh_lease_expiries_total",
            "Leases that expired and had their blocks reclaimed, by kind.",
            ["kind"],
            registry=r,
        )
        self.auth_refused = Counter(
            "kvmesh_auth_refused_total",
            "Calls to this worker refused for a missing or wrong cluster token.",
            registry=r,
        )
        self.blocks = Gauge(
            "kvmesh_kv_blocks", "KV blocks by state (free, used, cached).", ["state"], registry=r
        )
        self.running = Gauge("kvmesh_running_sequences", "Sequences in the batch.", registry=r)
        self.waiting = Gauge("kvmesh_waiting_sequences", "Sequences waiting.", registry=r)
        self.prefix_hit_tokens = Counter(
            "kvmesh_prefix_cache_hit_tokens_total", "Prompt tokens served from cache.", registry=r
        )
        self.prefix_query_tokens = Counter(
            "kvmesh_prefix_cache_query_tokens_total", "Prompt tokens looked up.", registry=r
        )


def serve_metrics(metrics: WorkerMetrics, port: int, addr: str = "127.0.0.1") -> int:
    """Serve `metrics` as Prometheus text on http://addr:port/metrics; port 0 picks a free one.

    Returns the bound port.
    """
    server, _thread = start_http_server(port, addr=addr, registry=metrics.registry)
    return int(server.server_port)
