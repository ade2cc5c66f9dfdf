"""One benchmark session: a backend, a system to drive, the runs of a sweep, the result.

`embedded(...)` starts a local kvmesh (`kvmesh.cli.up.LocalSystem`, disaggregated 1P+1D or one
colocated worker) and yields it; `sweep(...)` warms the backend up (requests not recorded),
then sends the workload once per arrival and returns the JSON-ready result that `--json`
prints and the plots read.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any

from kvmesh.loadgen.backends import Backend
from kvmesh.loadgen.metrics import Slo, by_group, latencies, summarize
from kvmesh.loadgen.runner import Arrival, run_load
from kvmesh.loadgen.workloads import BenchRequest

MODES = ("disaggregated", "colocated")


@dataclass(frozen=True)
class Embedded:
    """A local system to start: `mode`, the model, worker threads and extra worker flags."""

    model: str | None = None
    mode: str = "disaggregated"
    threads: int | None = None
    worker_args: tuple[str, ...] = ()
    http: bool = False  # also open the OpenAI-compatible HTTP door
    startup_timeout: float = 300.0


@contextmanager
def embedded(spec: Embedded) -> Iterator[Any]:
    """A started LocalSystem of `spec` (stopped on exit)."""
    from kvmesh.cli.up import LocalSystem, UpConfig, resolve_model

    if spec.mode not in MODES:
        raise ValueError(f"--embedded must be one of {', '.join(MODES)}; got {spec.mode!r}")
    pair = 0 if spec.mode == "colocated" else 1
    config = UpConfig(model=resolve_model(spec.model), prefill=pair, decode=pair,
                      colocated=1 - pair, port=0, http_port=0 if spec.http else None,
                      threads=spec.threads, worker_args=spec.worker_args,
                      startup_timeout=spec.startup_timeout, drain_seconds=5.0)  # fmt: skip
    with LocalSystem(config) as system:
        yield system


def warmup_requests(requests: Sequence[BenchRequest], count: int) -> list[BenchRequest]:
    """`count` short requests (16 prompt tokens or characters, 4 output tokens)."""
    first = requests[0]
    return [replace(first, prompt=first.prompt[:16], prompt_len=min(16, first.prompt_len),
                    output_len=4, at=None) for _ in range(count)]  # fmt: skip


def rate_value(rate: float) -> float | None:
    """A rate as JSON holds it (None: all at once)."""
    return None if math.isinf(rate) else rate


async def sweep(
    backend: Backend, requests: list[BenchRequest], arrivals: Sequence[Arrival], slo: Slo,
    warmup: int = 1, progress: bool = True,
) -> list[dict[str, Any]]:  # fmt: skip
    """One run per arrival: {"rate", "concurrency", "arrival", "summary", "groups",
    "samples"} (samples: each latency's values in ms)."""
    if warmup:
        await run_load(backend, warmup_requests(requests, warmup), Arrival(), progress=False)
    runs = []
    for arrival in arrivals:
        result = await run_load(backend, requests, arrival, progress, arrival.describe())
        samples = {
            k: [round(v * 1000, 3) for v in vs] for k, vs in latencies(result.records).items()
        }
        runs.append({
            "rate": rate_value(arrival.rate) if arrival.concurrency is None else None,
            "concurrency": arrival.concurrency,
            "arrival": arrival.describe(),
            "summary": summarize(result.records, result.duration, slo),
            "groups": by_group(result.records, result.duration, slo),
            "samples": samples,
        })  # fmt: skip
    return runs
