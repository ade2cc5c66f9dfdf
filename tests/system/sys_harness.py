"""Helpers of the system tests: start a local system, scrape metrics, wait with deadlines."""

from __future__ import annotations

import socket
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from kvmesh.cli.up import LocalSystem, UpConfig

# Short leases so that death is noticed quickly; every wait in the tests is bounded by these.
CONTROL_ARGS = ("--lease-seconds", "2", "--heartbeat-interval", "0.5", "--reservation-lease", "5")
GREEDY: dict[str, Any] = {"max_tokens": 12, "temperature": 0.0, "ignore_eos": True}
WORKER_ARGS = ("--num-kv-blocks", "256", "--drain-seconds", "2")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def local_system(**overrides: Any) -> Iterator[tuple[LocalSystem, str]]:
    """A started LocalSystem (front door on a free port; `kvmesh up` puts the control plane's
    metrics on another) on the tiny test model unless `model` is given."""
    from kvmesh.models.tiny import tiny_model_path

    overrides.setdefault("model", str(tiny_model_path()))
    overrides.setdefault("drain_seconds", 2.0)
    config = UpConfig(
        port=0,
        startup_timeout=240.0,
        control_args=CONTROL_ARGS,
        worker_args=WORKER_ARGS,
        **overrides,
    )
    with LocalSystem(config) as system:
        yield system, system.endpoint


def scrape(address: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Prometheus samples of http://address/metrics as {(name, sorted labels): value}."""
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=5) as response:
        text = response.read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples


def sample(address: str, name: str, **labels: str) -> float:
    return scrape(address).get((name, tuple(sorted(labels.items()))), 0.0)


def total(address: str, name: str, **labels: str) -> float:
    """The sum of `name`'s samples whose labels include `labels` (others free)."""
    wanted = set(labels.items())
    return sum(v for (n, ls), v in scrape(address).items() if n == name and wanted <= set(ls))


def used_blocks(system: LocalSystem) -> dict[str, float]:
    """KV blocks in use (held by requests) on every live, ready worker."""
    return {
        w.child.name: sample(w.ready["metrics_address"], "kvmesh_kv_blocks", state="used")
        for w in system.workers
        if w.child.alive() and w.ready
    }


def ledger_entries(system: LocalSystem) -> float:
    """Live ledger entries, all states together."""
    return total(system.control_metrics, "kvmesh_control_ledger_entries")


def live_workers(system: LocalSystem, role: str) -> float:
    """Workers of `role` the control plane counts as alive."""
    return sample(system.control_metrics, "kvmesh_control_workers", role=role)


def wait_until(predicate: Callable[[], bool], seconds: float, what: str) -> float:
    """Poll `predicate` until true; returns the seconds it took, AssertionError at the bound."""
    start = time.monotonic()
    while not predicate():
        if time.monotonic() - start > seconds:
            raise AssertionError(f"{what}: not within {seconds} s")
        time.sleep(0.02)
    return time.monotonic() - start


def idle(system: LocalSystem) -> bool:
    """No blocks held on any worker and no ledger entry."""
    return not any(used_blocks(system).values()) and ledger_entries(system) == 0


def openai_client(system: LocalSystem, **kwargs: Any) -> Any:
    """The official `openai` client of `system`'s HTTP door (no retries, any key unless
    `api_key` is given; other `kwargs` go to `openai.OpenAI`)."""
    import openai

    options: dict[str, Any] = {"api_key": "unused", "max_retries": 0, **kwargs}
    return openai.OpenAI(base_url=f"{system.http_url}/v1", **options)
