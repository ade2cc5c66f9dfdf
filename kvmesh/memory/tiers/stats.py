"""Per-tier counters and the plain-number snapshot the metrics exporter reads."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(slots=True)
class TierCounters:
    """Monotonic counts of one tier (host or disk)."""

    hits: int = 0  # prefix blocks found here by a lookup
    spills: int = 0  # blocks written into this tier from the tier above
    reloads: int = 0  # blocks copied out of this tier towards the device
    dropped: int = 0  # blocks that left this tier with no copy below (capacity)
    corrupt: int = 0  # files that failed verification (disk)
    bytes_in: int = 0
    bytes_out: int = 0
    reload_seconds: float = 0.0  # summed latency of the reloads (batches) out of this tier
    reload_batches: int = 0
    copy_seconds: float = 0.0  # time inside the host -> device copies alone
    copy_bytes: int = 0


@dataclass(frozen=True, slots=True)
class TierSnapshot:
    tier: str
    capacity_blocks: int
    used_blocks: int
    capacity_bytes: int
    used_bytes: int
    hits: int
    spills: int
    reloads: int
    dropped: int
    corrupt: int
    bytes_moved: int
    reload_latency_mean_s: float

    def as_dict(self) -> dict[str, float | int | str]:
        return asdict(self)


def snapshot(
    name: str, capacity: int, used: int, block_bytes: int, c: TierCounters
) -> TierSnapshot:
    latency = c.reload_seconds / c.reload_batches if c.reload_batches else 0.0
    return TierSnapshot(
        name,
        capacity,
        used,
        capacity * block_bytes,
        used * block_bytes,
        c.hits,
        c.spills,
        c.reloads,
        c.dropped,
        c.corrupt,
        c.bytes_in + c.bytes_out,
        latency,
    )


@dataclass(slots=True)
class SwapCounters:
    """Preemption choices and swap traffic."""

    swapped_out: int = 0  # sequences
    swapped_in: int = 0
    swap_bytes: int = 0
