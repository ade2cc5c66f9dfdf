"""W2 contiguous preallocation: each request reserves one extent of the arena at admission."""

from __future__ import annotations

from collections import defaultdict, deque
from collections.abc import Sequence

from kvmesh.memory.sim_arena import ExtentArena
from kvmesh.memory.sim_metrics import SimRequest, SimResult, SimulationError, StepMetrics


def simulate_contiguous(
    requests: Sequence[SimRequest],
    *,
    budget: int,
    max_len: int | None = 2048,
    name: str = "contiguous",
) -> SimResult:
    """Run FCFS contiguous preallocation until every request finishes.

    Each step: admit queue heads while first fit finds an extent (`max_len` slots, or exactly
    the request's total length when `max_len` is None), then every running request appends one
    token, metrics are sampled, and requests that reached their total length free their extent.
    A request admitted at step s with output length o finishes in step s + o − 1. Never preempts.
    """
    _validate(requests, budget, max_len)
    arena = ExtentArena(budget)
    queue = deque(requests)
    placed: dict[int, tuple[int, int]] = {}  # request id -> (offset, reserved slots)
    finishing: defaultdict[int, list[SimRequest]] = defaultdict(list)
    metrics = StepMetrics(budget)
    live = reserved = 0
    step = 0
    while queue or placed:
        while queue:
            size = _reservation(queue[0], max_len)
            offset = arena.allocate(size)
            if offset is None:
                break
            request = queue.popleft()
            placed[request.request_id] = (offset, size)
            finishing[step + request.output_len - 1].append(request)
            live += request.prompt_len
            reserved += size
        live += len(placed)
        waiting = arena.unusable_slots(_reservation(queue[0], max_len)) if queue else 0
        metrics.record(live=live, reserved=reserved, running=len(placed), external_free=waiting)
        for request in finishing.pop(step, ()):
            offset, size = placed.pop(request.request_id)
            arena.free(offset, size)
            live -= request.total_len
            reserved -= size
        step += 1
    return metrics.result(name, preemptions=0)


def _reservation(request: SimRequest, max_len: int | None) -> int:
    return request.total_len if max_len is None else max_len


def _validate(requests: Sequence[SimRequest], budget: int, max_len: int | None) -> None:
    if budget < 1:
        raise SimulationError(f"budget: {budget} must be positive")
    if max_len is not None and not 0 < max_len <= budget:
        raise SimulationError(f"max_len: {max_len} must be in [1, budget={budget}]")
    limit = budget if max_len is None else max_len
    for request in requests:
        if request.total_len > limit:
            raise SimulationError(
                f"total_len: request {request.request_id} needs {request.total_len} slots, "
                f"more than {limit}"
            )
