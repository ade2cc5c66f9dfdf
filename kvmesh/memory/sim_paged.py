"""W2 paged allocation: blocks on demand, preemption of the newest request by recompute.

Preemption keeps generated progress: the victim frees all its blocks and goes back to the
front of the queue; on re-admission it is re-prefilled (recomputed) over its prompt plus the
tokens it had already generated, so it needs ceil((prompt + generated) / block_size) blocks.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from kvmesh.memory.sim_metrics import SimRequest, SimResult, SimulationError, StepMetrics


class AdmissionPolicy(Protocol):
    """Decides whether the queue head may be admitted now."""

    def allows(self, *, free_blocks: int, need_blocks: int, running: int, block_size: int) -> bool:
        """`need_blocks` hold the head's context; `running` requests run before it joins."""
        ...


@dataclass(frozen=True)
class GreedyAdmission:
    """Admit while the head's context fits in the free blocks."""

    def allows(self, *, free_blocks: int, need_blocks: int, running: int, block_size: int) -> bool:
        return need_blocks <= free_blocks


@dataclass(frozen=True)
class WatermarkAdmission:
    """Admit only if, afterwards, room for `headroom_tokens` more tokens per running request
    (the newcomer included) stays free: ceil(headroom_tokens × (running + 1) / block_size)
    blocks.

    The headroom grows with the batch, so the whole batch can keep appending for about
    `headroom_tokens` steps before anyone must be preempted, while finishing requests refill
    it; an idle pool admits whenever the context fits.
    """

    headroom_tokens: int = 24

    def allows(self, *, free_blocks: int, need_blocks: int, running: int, block_size: int) -> bool:
        if running == 0:
            return need_blocks <= free_blocks
        headroom = -(-self.headroom_tokens * (running + 1) // block_size)
        return need_blocks + headroom <= free_blocks


class _Sequence:
    """A request's paged state: tokens held (`length`) and blocks allocated."""

    __slots__ = ("blocks", "length", "request")

    def __init__(self, request: SimRequest) -> None:
        self.request = request
        self.length = request.prompt_len
        self.blocks = 0


class _PagedPool:
    """Free-block count, running sequences in admission order, and the queue."""

    def __init__(self, requests: Sequence[SimRequest], budget: int, block_size: int) -> None:
        self.block_size = block_size
        self.num_blocks = budget // block_size
        self.free = self.num_blocks
        self.live = 0
        self.preemptions = 0
        self.running: list[_Sequence] = []
        self.queue: deque[_Sequence] = deque(_Sequence(request) for request in requests)

    def admit(self, policy: AdmissionPolicy) -> None:
        while self.queue:
            head = self.queue[0]
            need = -(-head.length // self.block_size)
            running = len(self.running)
            if not policy.allows(
                free_blocks=self.free, need_blocks=need, running=running, block_size=self.block_size
            ):
                return
            self.queue.popleft()
            head.blocks = need
            self.free -= need
            self.live += head.length
            self.running.append(head)

    def append_tokens(self) -> list[_Sequence]:
        """Every running sequence appends one token, oldest first; returns those now finished."""
        finished = []
        index = 0
        while index < len(self.running):
            sequence = self.running[index]
            if sequence.length % self.block_size == 0 and not self._grant_block(sequence):
                break  # the sequence preempted itself: it was the newest
            sequence.length += 1
            self.live += 1
            if sequence.length == sequence.request.total_len:
                finished.append(sequence)
            index += 1
        return finished

    def _grant_block(self, sequence: _Sequence) -> bool:
        """One more block for `sequence`, preempting newest first; False if it was preempted."""
        while self.free == 0:
            victim = self.running.pop()
            self.free += victim.blocks
            self.live -= victim.length
            victim.blocks = 0
            self.queue.appendleft(victim)
            self.preemptions += 1
            if victim is sequence:
                return False
        self.free -= 1
        sequence.blocks += 1
        return True

    def release(self, finished: list[_Sequence]) -> None:
        if not finished:
            return
        done = {id(sequence) for sequence in finished}
        self.running = [sequence for sequence in self.running if id(sequence) not in done]
        for sequence in finished:
            self.free += sequence.blocks
            self.live -= sequence.length


def simulate_paged(
    requests: Sequence[SimRequest],
    *,
    budget: int,
    block_size: int = 16,
    admission: AdmissionPolicy | None = None,
    name: str | None = None,
) -> SimResult:
    """Run FCFS paged allocation (default admission: `WatermarkAdmission()`) to completion.

    Each step: admit queue heads the policy allows (each takes blocks for its whole context,
    prefill without chunking), every running request appends one token (taking a block at a
    block boundary, preempting the newest running request when none is free), metrics are
    sampled, finished requests free their blocks. Free blocks always fit any request's next
    block, so external fragmentation is 0.
    """
    _validate(requests, budget, block_size)
    policy = admission if admission is not None else WatermarkAdmission()
    pool = _PagedPool(requests, budget, block_size)
    metrics = StepMetrics(budget)
    while pool.queue or pool.running:
        pool.admit(policy)
        if not pool.running:
            raise SimulationError("admission: the policy admits nothing into an idle pool")
        finished = pool.append_tokens()
        reserved = (pool.num_blocks - pool.free) * block_size
        metrics.record(
            live=pool.live, reserved=reserved, running=len(pool.running), external_free=0
        )
        pool.release(finished)
    return metrics.result(name or f"paged-{block_size}", preemptions=pool.preemptions)


def _validate(requests: Sequence[SimRequest], budget: int, block_size: int) -> None:
    if block_size < 1 or budget < block_size:
        raise SimulationError(f"block_size: {block_size} must be in [1, budget={budget}]")
    capacity = (budget // block_size) * block_size
    for request in requests:
        if request.total_len > capacity:
            raise SimulationError(
                f"total_len: request {request.request_id} needs {request.total_len} slots, "
                f"more than the pool's {capacity}"
            )
