"""Sending a workload: arrival processes and the progress bar.

Arrivals: `poisson` (exponential gaps of mean 1/rate, `random.Random(seed)`), `fixed` (one
request every 1/rate seconds), rate `inf` (all at time 0), or `concurrency` (N requests in
flight at all times, the next sent as one finishes). Requests with their own `at` (W4, traces
with times) keep it under the rate-based processes unless `ignore_schedule`.
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from kvmesh.loadgen.backends import Backend, RequestRecord
from kvmesh.loadgen.workloads import BenchRequest

ARRIVALS = ("poisson", "fixed")
Send = Callable[[int], Awaitable[RequestRecord]]


@dataclass(frozen=True)
class Arrival:
    """How requests are released: at `rate` per second (math.inf: all at once) by `process`,
    or with `concurrency` in flight (rate ignored)."""

    rate: float = math.inf
    process: str = "poisson"
    concurrency: int | None = None
    seed: int = 0
    ignore_schedule: bool = False

    def __post_init__(self) -> None:
        if self.process not in ARRIVALS:
            raise ValueError(
                f"--arrival must be one of {', '.join(ARRIVALS)}; got {self.process!r}"
            )
        if not self.rate > 0:
            raise ValueError(f"--request-rate must be > 0, got {self.rate}")
        if self.concurrency is not None and self.concurrency <= 0:
            raise ValueError(f"--concurrency must be > 0, got {self.concurrency}")

    def describe(self) -> str:
        if self.concurrency is not None:
            return f"concurrency {self.concurrency}"
        return "all at once" if math.isinf(self.rate) else f"{self.process} {self.rate:g} req/s"

    def offsets(self, requests: list[BenchRequest]) -> list[float]:
        """Send time of each request, seconds after the start."""
        rng = random.Random(self.seed)
        clock, out = 0.0, []
        for i, request in enumerate(requests):
            if request.at is not None and not self.ignore_schedule:
                out.append(request.at)
                continue
            if i and not math.isinf(self.rate):
                clock += rng.expovariate(self.rate) if self.process == "poisson" else 1 / self.rate
            out.append(clock)
        return out


@dataclass
class RunResult:
    records: list[RequestRecord]
    duration: float  # first send to last answer (seconds)


async def run_load(
    backend: Backend, requests: list[BenchRequest], arrival: Arrival, progress: bool = True,
    description: str = "requests",
) -> RunResult:  # fmt: skip
    """Send every request by `arrival`, each on its own task; records in request order."""
    from tqdm import tqdm

    bar = tqdm(total=len(requests), desc=description, unit="req", disable=not progress,
               leave=False, dynamic_ncols=True)  # fmt: skip
    start = time.perf_counter()

    async def one(index: int) -> RequestRecord:
        record = await backend.send(index, requests[index])
        bar.update(1)
        return record

    try:
        if arrival.concurrency is not None:
            records = await _closed_loop(one, len(requests), arrival.concurrency)
        else:
            records = await _open_loop(one, arrival.offsets(requests), start)
    finally:
        bar.close()
    end = max((r.chunk_times[-1] for r in records if r.chunk_times), default=time.perf_counter())
    return RunResult(records, end - start)


async def _open_loop(one: Send, offsets: list[float], start: float) -> list[RequestRecord]:
    async def at(index: int) -> RequestRecord:
        await asyncio.sleep(max(0.0, start + offsets[index] - time.perf_counter()))
        return await one(index)

    return list(await asyncio.gather(*(at(i) for i in range(len(offsets)))))


async def _closed_loop(one: Send, count: int, concurrency: int) -> list[RequestRecord]:
    queue = iter(range(count))
    results: dict[int, RequestRecord] = {}

    async def worker() -> None:
        for index in queue:
            results[index] = await one(index)

    await asyncio.gather(*(worker() for _ in range(min(concurrency, count))))
    return [results[i] for i in range(count)]
