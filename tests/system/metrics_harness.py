"""Scrape every process of a local system, and what a known set of requests must move."""

from __future__ import annotations

import urllib.request
from dataclasses import dataclass, field
from typing import Any

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families
from sys_harness import GREEDY

from kvmesh.cli.up import LocalSystem
from kvmesh.client import Client, InvalidArgument, Result

Labels = tuple[tuple[str, str], ...]
PREFIX = [(7 * i) % 900 + 20 for i in range(64)]  # four full 16-token blocks, shared
PROMPTS: list[Any] = [[*PREFIX, 901, 902, 903], [*PREFIX, 904, 905], [30, 31, 32, 33], PREFIX]
# Families whose resting value is legitimately 0, moved in the colocated run only.
UNDER_PRESSURE_ONLY = {"kvmesh:num_requests_waiting", "kvmesh:num_preemptions"}
# Moves only when a worker is lost before the first token (control-plane retry tests).
ON_WORKER_LOSS_ONLY = {"kvmesh_control_retries"}


@dataclass
class Scrape:
    """One endpoint's exposition: samples by (name, sorted labels), families by name/type."""

    samples: dict[tuple[str, Labels], float] = field(default_factory=dict)
    families: dict[str, str] = field(default_factory=dict)

    def total(self, name: str, **labels: str) -> float:
        wanted = set(labels.items())
        return sum(v for (n, ls), v in self.samples.items() if n == name and wanted <= set(ls))


def scrape(address: str) -> Scrape:
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=5) as response:
        text = response.read().decode()
    out = Scrape()
    for family in text_string_to_metric_families(text):
        out.families[family.name] = family.type
        for s in family.samples:
            out.samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def endpoints(system: LocalSystem) -> dict[str, str]:
    """Metrics address of the control plane and of each worker, by role (one per role)."""
    workers = {w.role: w.ready["metrics_address"] for w in system.workers}
    return {"control": system.control_metrics, **workers}


def scrape_all(system: LocalSystem) -> dict[str, Scrape]:
    return {name: scrape(address) for name, address in endpoints(system).items()}


def run_known_requests(system: LocalSystem) -> list[Result]:
    """The OK requests (greedy, 12 tokens each, a shared prefix), then one rejected."""
    client = Client(system.endpoint, timeout=60)
    results = [client.complete(prompt, **GREEDY) for prompt in PROMPTS]
    with pytest.raises(InvalidArgument, match="temperature"):
        client.complete("hi", temperature=-1.0)
    return results


def refuse_unauthenticated(system: LocalSystem) -> None:
    """One call without the cluster token to every worker and to the internal door."""
    service = {"decode": "DecodeService"}
    targets = [
        (w.ready["address"], f"/kvmesh.v1.{service.get(w.role, 'PrefillService')}/Release")
        for w in system.workers
    ]
    targets.append((system.internal_endpoint, "/kvmesh.v1.ControlService/Heartbeat"))
    for address, method in targets:
        with grpc.insecure_channel(address) as channel:
            call = channel.unary_unary(method)
            with pytest.raises(grpc.RpcError) as error:
                call(b"", timeout=5)
            assert error.value.code() == grpc.StatusCode.UNAUTHENTICATED, address


def moved(name: str, kind: str, scrapes: list[Scrape]) -> bool:
    """A counter whose total, a histogram whose count, a gauge whose value left 0 in any of
    `scrapes` (prometheus_client's `_created` samples are not movement)."""
    suffix = {"counter": "_total", "histogram": "_count"}.get(kind, "")
    return any(
        value != 0
        for s in scrapes
        for (sample, _), value in s.samples.items()
        if sample == name + suffix
    )


def dead_families(
    history: dict[str, list[Scrape]], exempt: set[str], kinds: tuple[str, ...] = ()
) -> list[str]:
    """`process/family` for every family an endpoint exports that never moved (`exempt`:
    family names, or `process/family`; `kinds`: only families of these types)."""
    dead = []
    for process, scrapes in history.items():
        for name, kind in scrapes[-1].families.items():
            if exempt & {name, f"{process}/{name}"} or (kinds and kind not in kinds):
                continue
            if not moved(name, kind, scrapes):
                dead.append(f"{process}/{name}")
    return dead
