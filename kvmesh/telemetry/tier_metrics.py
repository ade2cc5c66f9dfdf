"""Prometheus families of the host and disk KV tiers and of the preemption choice.

Read from the engine's TieredStore at every scrape (plain integer reads, no lock):
`kvmesh_kv_tier_{capacity,used}_bytes{tier}`, `kvmesh_kv_tier_{hits,spills,reloads,dropped,
corrupt}_total{tier}` (blocks), `kvmesh_kv_tier_moved_bytes_total{tier}`,
`kvmesh_kv_tier_reload_latency_mean_seconds{tier}` and `kvmesh_preemptions_total{mode}`
(swap or recompute, as the scheduler chose).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

GAUGES = {
    "capacity_bytes": "Capacity of the KV tier.",
    "used_bytes": "KV bytes held by the tier.",
    "reload_latency_mean_seconds": "Mean latency of one reload batch out of the tier.",
}
COUNTERS = {
    "hits": "Prefix blocks a lookup found in the tier.",
    "spills": "Blocks written into the tier from the tier above.",
    "reloads": "Blocks copied out of the tier towards the device.",
    "dropped": "Blocks that left the tier with no copy below it.",
    "corrupt": "Block files that failed verification and were ignored.",
}
_FIELDS = {"reload_latency_mean_seconds": "reload_latency_mean_s"}


class TierCollector:
    """Collects from `engine()` (an LLMEngine, or None while there is none)."""

    def __init__(self, engine: Callable[[], Any]) -> None:
        self._engine = engine

    def collect(self) -> Iterator[Metric]:
        engine = self._engine()
        store = None if engine is None else engine.parts.tiers
        if store is None:
            return
        snapshots = store.metrics()
        for name, doc in GAUGES.items():
            family = GaugeMetricFamily(f"kvmesh_kv_tier_{name}", doc, labels=["tier"])
            for snap in snapshots:
                family.add_metric([snap.tier], getattr(snap, _FIELDS.get(name, name)))
            yield family
        for name, doc in COUNTERS.items():
            counter = CounterMetricFamily(f"kvmesh_kv_tier_{name}", doc, labels=["tier"])
            for snap in snapshots:
                counter.add_metric([snap.tier], getattr(snap, name))
            yield counter
        moved = CounterMetricFamily(
            "kvmesh_kv_tier_moved_bytes", "KV bytes moved in or out of the tier.", labels=["tier"]
        )
        for snap in snapshots:
            moved.add_metric([snap.tier], snap.bytes_moved)
        yield moved
        chooser = engine.scheduler.state.chooser
        if chooser is not None:
            choice = CounterMetricFamily(
                "kvmesh_preemptions", "Preempted sequences by how.", labels=["mode"]
            )
            choice.add_metric(["swap"], chooser.num_swap)
            choice.add_metric(["recompute"], chooser.num_recompute)
            yield choice


def register_tier_metrics(registry: CollectorRegistry, engine: Callable[[], Any]) -> None:
    registry.register(TierCollector(engine))  # type: ignore[arg-type]
