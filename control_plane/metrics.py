"""Prometheus metrics of the control plane, on a registry of its own (one per server).

The front door sees every request whole (both modes), so the request-level families are
here, under vLLM's names with a `kvmesh:` prefix and a `model_name` label; engine families
(running, waiting, KV usage, prefix cache, preemptions, iteration tokens) are the workers'
(`kvmesh/telemetry/metrics.py`). Each name is exported by one kind of process only, so sums
over every scraped target count each thing once. Status labels are gRPC code names.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

TTFT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5)
REQUEST_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
LENGTH_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000)
LEASE_EVENTS = ("granted", "renewed", "expired")


class LedgerCollector(Collector):
    """`kvmesh_control_ledger_entries{state}`: live entries per ownership state, every state
    exported (0 included), counted at scrape time from `states()`."""

    def __init__(self, states: Callable[[], dict[str, int]], names: tuple[str, ...]) -> None:
        self.states = states
        self.names = names

    def collect(self) -> Iterator[Metric]:
        counts = self.states()
        family = GaugeMetricFamily(
            "kvmesh_control_ledger_entries",
            "Live ledger entries by state (who owns the request's blocks).",
            labels=["state"],
        )
        for name in self.names:
            family.add_metric([name], counts.get(name, 0))
        yield family


class RequestMetrics:
    """vLLM's request-level families, recorded by the front door once a request ended."""

    def __init__(self, r: CollectorRegistry) -> None:
        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, ["model_name"], buckets=buckets, registry=r)

        def counter(name: str, doc: str, *labels: str) -> Counter:
            return Counter(name, doc, ["model_name", *labels], registry=r)

        self.ttft = histogram(
            "kvmesh:time_to_first_token_seconds",
            "Arrival at the front door to the first token relayed (OK requests).",
            TTFT_BUCKETS,
        )
        self.inter_token = histogram(
            "kvmesh:inter_token_latency_seconds",
            "Time between consecutive tokens of one completion as relayed (one per token "
            "after a completion's first).",
            TOKEN_BUCKETS,
        )
        self.tpot = histogram(
            "kvmesh:time_per_output_token_seconds",
            "Mean time per output token after the first, one per completion of 2+ tokens.",
            TOKEN_BUCKETS,
        )
        self.e2e = histogram(
            "kvmesh:e2e_request_latency_seconds", "Arrival to the last token.", REQUEST_BUCKETS
        )
        self.queue = histogram(
            "kvmesh:request_queue_time_seconds",
            "Time waiting before prefill (front door and worker queues).",
            REQUEST_BUCKETS,
        )
        self.prefill = histogram(
            "kvmesh:request_prefill_time_seconds",
            "Prefill compute of the prompt (KV transfer excluded).",
            REQUEST_BUCKETS,
        )
        self.decode = histogram(
            "kvmesh:request_decode_time_seconds", "First token to the last.", REQUEST_BUCKETS
        )
        self.prompt_length = histogram(
            "kvmesh:request_prompt_tokens", "Prompt tokens per request.", LENGTH_BUCKETS
        )
        self.generation_length = histogram(
            "kvmesh:request_generation_tokens",
            "Tokens generated per request (all completions).",
            LENGTH_BUCKETS,
        )
        self.prompt_tokens = counter(
            "kvmesh:prompt_tokens", "Prompt tokens of requests that reached a worker."
        )
        self.generation_tokens = counter(
            "kvmesh:generation_tokens", "Tokens relayed to clients (every status)."
        )
        self.success = counter(
            "kvmesh:request_success",
            "Requests that ended OK, by the finish reason of completion 0 (stop, length).",
            "finished_reason",
        )


class ControlMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "kvmesh_control_requests",
            "Generate requests by final gRPC status (rejections at either door included)",
            ["status"],
            registry=r,
        )
        self.request = RequestMetrics(r)
        self.ttft_phase = Histogram(
            "kvmesh_control_ttft_phase_seconds", "TTFT by phase (queue, prefill, transfer, "
            "first_decode)", ["phase"], buckets=TTFT_BUCKETS, registry=r,
        )  # fmt: skip
        self.worker_leases = Counter(
            "kvmesh_control_worker_leases",
            "Worker leases by role and event (granted at Register, renewed by Heartbeat, "
            "expired when declared dead)",
            ["role", "event"],
            registry=r,
        )
        self.retries = Counter(
            "kvmesh_control_retries", "Requests retried on another worker", registry=r
        )
        self.inflight = Gauge("kvmesh_control_inflight", "Generate calls in flight", registry=r)
        self.workers = Gauge(
            "kvmesh_control_workers", "Live registered workers", ["role"], registry=r
        )
        self.auth_refused = Counter(
            "kvmesh_control_auth_refused", "Calls refused for a missing or wrong cluster token "
            "(door internal) or API key (doors public, http)", ["door"], registry=r,
        )  # fmt: skip

    def watch_ledger(self, states: Callable[[], dict[str, int]], names: tuple[str, ...]) -> None:
        """Export `kvmesh_control_ledger_entries{state}` from `states()` at every scrape."""
        self.registry.register(LedgerCollector(states, names))
