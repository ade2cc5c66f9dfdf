"""Workload W2: contiguous preallocation against paged KV blocks (the memory table of
“KV Cache从原理到实战：大模型推理内存管理演进与优化”, §6.3).

A budget of 65,536 token slots, 2,000 requests from `random.Random(0)` with prompt and output
lengths `randint(64, 1024)` each, all waiting at time 0, admitted first come first served.
Metric definitions are in `kvmesh.memory.sim_metrics`; the allocators in `sim_contiguous`
(first fit in one arena, reserving `max_len = 2048`) and `sim_paged` (blocks on demand,
preemption of the newest request by recompute).

Allocators run by `run_w2`:

| name | allocation | admission |
|---|---|---|
| contiguous | one 2048-slot extent per request | first fit succeeds |
| contiguous-exact | one extent of exactly prompt + output (an oracle) | first fit succeeds |
| paged-8/16/32 | blocks of 8/16/32 on demand | `WatermarkAdmission` |
| paged-16-greedy | blocks of 16 on demand | prompt fits (`GreedyAdmission`) |
"""

from __future__ import annotations

import random
from collections.abc import Callable

from kvmesh.memory.sim_contiguous import simulate_contiguous
from kvmesh.memory.sim_metrics import SimRequest, SimResult, SimulationError
from kvmesh.memory.sim_paged import GreedyAdmission, WatermarkAdmission, simulate_paged

__all__ = [
    "W2_BUDGET",
    "W2_MAX_LEN",
    "W2_REQUESTS",
    "GreedyAdmission",
    "SimRequest",
    "SimResult",
    "SimulationError",
    "WatermarkAdmission",
    "run_w2",
    "simulate_contiguous",
    "simulate_paged",
    "w2_allocators",
    "w2_requests",
]

W2_BUDGET = 65_536
W2_MAX_LEN = 2048
W2_REQUESTS = 2000
W2_LENGTHS = (64, 1024)

Allocator = Callable[[list[SimRequest], int], SimResult]


def w2_requests(num_requests: int = W2_REQUESTS, seed: int = 0) -> list[SimRequest]:
    """W2's requests: for each in order, prompt = randint(64, 1024), output = randint(64, 1024)."""
    if num_requests < 1:
        raise SimulationError(f"requests: {num_requests} must be positive")
    rng = random.Random(seed)
    requests = []
    for request_id in range(num_requests):
        prompt = rng.randint(*W2_LENGTHS)
        output = rng.randint(*W2_LENGTHS)
        requests.append(SimRequest(request_id, prompt, output))
    return requests


def w2_allocators() -> dict[str, Allocator]:
    """The allocators W2 compares, by report name; each maps (requests, budget) to a result."""

    def contiguous(max_len: int | None, name: str) -> Allocator:
        return lambda reqs, budget: simulate_contiguous(
            reqs, budget=budget, max_len=max_len, name=name
        )

    def paged(block_size: int, name: str, greedy: bool = False) -> Allocator:
        policy = GreedyAdmission() if greedy else WatermarkAdmission()
        return lambda reqs, budget: simulate_paged(
            reqs, budget=budget, block_size=block_size, admission=policy, name=name
        )

    allocators = {
        "contiguous": contiguous(W2_MAX_LEN, "contiguous"),
        "contiguous-exact": contiguous(None, "contiguous-exact"),
    }
    for block_size in (8, 16, 32):
        allocators[f"paged-{block_size}"] = paged(block_size, f"paged-{block_size}")
    allocators["paged-16-greedy"] = paged(16, "paged-16-greedy", greedy=True)
    return allocators


def run_w2(
    num_requests: int = W2_REQUESTS,
    seed: int = 0,
    budget: int = W2_BUDGET,
    allocators: list[str] | None = None,
) -> dict[str, SimResult]:
    """Run W2 (or a reduced size) through each named allocator (default: all), in order."""
    available = w2_allocators()
    names = list(available) if allocators is None else allocators
    unknown = [name for name in names if name not in available]
    if unknown:
        raise SimulationError(f"allocators: unknown {unknown} (known: {list(available)})")
    requests = w2_requests(num_requests, seed)
    return {name: available[name](requests, budget) for name in names}
