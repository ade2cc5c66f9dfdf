"""Prometheus metrics of the control plane, on a registry of its own (one per server)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class ControlMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "kvmesh_control_requests", "Generate requests by final status", ["status"], registry=r
        )
        self.ttft = Histogram(
            "kvmesh_control_ttft_seconds", "Time to first token at the front door",
            buckets=TTFT_BUCKETS, registry=r,
        )  # fmt: skip
        self.ttft_phase = Histogram(
            "kvmesh_control_ttft_phase_seconds", "TTFT by phase (queue, prefill, transfer, "
            "first_decode)", ["phase"], buckets=TTFT_BUCKETS, registry=r,
        )  # fmt: skip
        self.lease_expiries = Counter(
            "kvmesh_control_worker_lease_expiries", "Workers declared dead", ["role"], registry=r
        )
        self.retries = Counter(
            "kvmesh_control_retries", "Requests retried on another worker", registry=r
        )
        self.ledger_entries = Gauge(
            "kvmesh_control_ledger_entries", "Live ledger entries", registry=r
        )
        self.inflight = Gauge("kvmesh_control_inflight", "Generate calls in flight", registry=r)
        self.workers = Gauge(
            "kvmesh_control_workers", "Live registered workers", ["role"], registry=r
        )
        self.auth_refused = Counter(
            "kvmesh_control_auth_refused", "Calls refused for a missing or wrong cluster token "
            "(door internal) or API key (doors public, http)", ["door"], registry=r,
        )  # fmt: skip
