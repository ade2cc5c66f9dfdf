"""Plain-number snapshot of the memory core, cheap to take every step (O(1))."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True, slots=True)
class MemoryMetrics:
    """Block counts satisfy free + evictable + in_use == total."""

    total_blocks: int
    free_blocks: int  # uncached, ref 0
    evictable_blocks: int  # cached, ref 0: reusable as cache hits until evicted
    protected_blocks: int  # the evictable blocks in the protected segment
    in_use_blocks: int  # ref >= 1
    usage: float  # in_use / total
    cached_blocks: int  # published in the prefix index (in use or evictable)
    prefix_queries: int
    prefix_query_tokens: int
    prefix_hit_tokens: int
    prefix_hit_rate: float  # hit tokens / query tokens
    evictions: int
    cow_copies: int
    hash_collisions: int  # index hits rejected by the token check

    def as_dict(self) -> dict[str, float | int]:
        return asdict(self)
