"""Swap or recompute a preempted sequence, by estimated cost, with measured rates.

swap cost      = 2 x its KV bytes / measured copy bandwidth (out now, back in later)
recompute cost = its computed tokens / measured prefill speed (tokens per second)

`mode` "swap" always swaps (while the host has room), "recompute" never does, "auto" picks the
cheaper estimate (recompute until both rates are measured). Choices are counted.
"""

from __future__ import annotations

from dataclasses import dataclass

PREEMPTION_MODES = ("auto", "swap", "recompute")
_SMOOTHING = 0.2  # weight of the newest sample in the moving averages


@dataclass(slots=True)
class Rates:
    """Exponential moving averages of copy bandwidth and prefill speed (None: unmeasured)."""

    bytes_per_s: float | None = None
    tokens_per_s: float | None = None

    def observe_copy(self, num_bytes: int, seconds: float) -> None:
        if num_bytes and seconds > 0:
            self.bytes_per_s = _mix(self.bytes_per_s, num_bytes / seconds)

    def observe_compute(self, num_tokens: int, seconds: float) -> None:
        if num_tokens and seconds > 0:
            self.tokens_per_s = _mix(self.tokens_per_s, num_tokens / seconds)


def _mix(old: float | None, new: float) -> float:
    return new if old is None else (1 - _SMOOTHING) * old + _SMOOTHING * new


@dataclass(slots=True)
class PreemptionChooser:
    mode: str
    block_bytes: int
    rates: Rates
    num_swap: int = 0
    num_recompute: int = 0

    def __post_init__(self) -> None:
        if self.mode not in PREEMPTION_MODES:
            raise ValueError(f"preemption must be one of {PREEMPTION_MODES}, got {self.mode!r}")

    def prefers_swap(self, num_blocks: int, num_tokens: int) -> bool:
        """Whether swapping `num_blocks` beats recomputing `num_tokens` (before counting)."""
        if self.mode != "auto":
            return self.mode == "swap"
        bandwidth, speed = self.rates.bytes_per_s, self.rates.tokens_per_s
        if bandwidth is None or speed is None:
            return False
        return 2 * num_blocks * self.block_bytes / bandwidth < num_tokens / speed

    def count(self, swapped: bool) -> None:
        if swapped:
            self.num_swap += 1
        else:
            self.num_recompute += 1
