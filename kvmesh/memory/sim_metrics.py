"""Shared pieces of the W2 memory simulation: requests, per-step metrics, results.

Metric definitions (all sampled once per step, after every running request has appended its
token and before finished requests free their memory, then averaged over steps):

- utilization = live token slots / reserved token slots (slots holding a token of a running
  request / slots allocated to running requests).
- kv_usage = live token slots / budget (how much of the whole budget holds live tokens; free
  headroom counts against it, unlike utilization).
- internal_fragmentation = (reserved − live) / budget: slots allocated to a request but not
  (yet) holding its tokens — the unfilled tail of a contiguous reservation, or of the last block.
- external_fragmentation = free slots that cannot serve the head-of-queue request / budget: free
  slots lying in free extents smaller than the head request's allocation unit (its whole
  reservation for contiguous; one block for paged, so always 0 there). 0 when nobody waits.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


class SimulationError(ValueError):
    """Bad simulation input; the message starts with the field name."""


@dataclass(frozen=True)
class SimRequest:
    """One request: `prompt_len` tokens prefilled at admission, then `output_len` decode steps."""

    request_id: int
    prompt_len: int
    output_len: int

    def __post_init__(self) -> None:
        for field in ("prompt_len", "output_len"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise SimulationError(f"{field}: {value!r} must be a positive integer")

    @property
    def total_len(self) -> int:
        """Token slots the request holds when it finishes."""
        return self.prompt_len + self.output_len


@dataclass(frozen=True)
class SimResult:
    """Per-allocator outcome of one simulation run (fractions in [0, 1])."""

    allocator: str
    utilization: float
    kv_usage: float
    mean_concurrency: float
    peak_concurrency: int
    preemptions: int
    steps: int
    internal_fragmentation: float
    external_fragmentation: float

    def to_dict(self) -> dict[str, float | int]:
        """The metrics without the allocator name (the name keys the JSON dict)."""
        fields = asdict(self)
        del fields["allocator"]
        return fields


class StepMetrics:
    """Accumulates per-step samples and averages them over steps."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.steps = 0
        self.peak_concurrency = 0
        self._utilization = 0.0
        self._live = 0
        self._concurrency = 0
        self._internal = 0
        self._external = 0

    def record(self, *, live: int, reserved: int, running: int, external_free: int) -> None:
        """One step's sample; `reserved` > 0 because some request runs in every step."""
        assert 0 < live <= reserved <= self.budget, (live, reserved, self.budget)
        self.steps += 1
        self._utilization += live / reserved
        self._live += live
        self._concurrency += running
        self._internal += reserved - live
        self._external += external_free
        self.peak_concurrency = max(self.peak_concurrency, running)

    def result(self, allocator: str, preemptions: int) -> SimResult:
        steps = max(self.steps, 1)
        per_budget = steps * self.budget
        return SimResult(
            allocator=allocator,
            utilization=self._utilization / steps,
            kv_usage=self._live / per_budget,
            mean_concurrency=self._concurrency / steps,
            peak_concurrency=self.peak_concurrency,
            preemptions=preemptions,
            steps=self.steps,
            internal_fragmentation=self._internal / per_budget,
            external_fragmentation=self._external / per_budget,
        )
