"""Watermarks of a lower tier: above `high` (a fraction of capacity) it sheds down to `low`."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Watermarks:
    high: float = 0.9
    low: float = 0.75

    def __post_init__(self) -> None:
        if not 0.0 < self.low <= self.high <= 1.0:
            raise ValueError(f"watermarks need 0 < low <= high <= 1, got {self.low}, {self.high}")

    def excess(self, used: int, capacity: int) -> int:
        """Blocks to shed now: 0 at or below the high mark, else down to the low mark."""
        if used <= self.high * capacity:
            return 0
        return used - int(self.low * capacity)
