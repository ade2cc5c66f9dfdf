"""Prefix-cache index: block hash -> block id, with the tokens of every cached block kept so a
hit is verified token by token (a hash collision is reported as a miss, never served).

Only full blocks whose KV is computed are published. One block per hash: if an identical block
is already cached under another id, the newcomer stays unpublished (it frees normally).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvmesh.memory.hashing import HashFn


@dataclass(frozen=True, slots=True)
class CachedBlock:
    """What a published block holds: its chain position and exact contents."""

    block_hash: int
    parent_hash: int | None
    tokens: tuple[int, ...]
    extra_key: bytes | None


class PrefixCache:
    """Maps chained block hashes to cached block ids; O(1) per operation."""

    def __init__(self) -> None:
        self._index: dict[int, int] = {}
        self._entries: dict[int, CachedBlock] = {}
        self.num_collisions = 0

    def __len__(self) -> int:
        return len(self._index)

    def match(
        self,
        block_hash: int,
        parent_hash: int | None,
        tokens: Sequence[int],
        extra_key: bytes | None,
    ) -> int | None:
        """Cached block id holding exactly this block (same chain, tokens and key), or None."""
        block = self._index.get(block_hash)
        if block is None:
            return None
        entry = self._entries[block]
        if (
            entry.parent_hash != parent_hash
            or entry.extra_key != extra_key
            or entry.tokens != tuple(tokens)
        ):
            self.num_collisions += 1
            return None
        return block

    def publish(self, block: int, entry: CachedBlock) -> bool:
        """Index `block` under `entry.block_hash`; False (nothing changed) if the hash is taken."""
        assert block not in self._entries, f"block {block} is already published"
        if entry.block_hash in self._index:
            return False
        self._index[entry.block_hash] = block
        self._entries[block] = entry
        return True

    def hash_of(self, block: int) -> int | None:
        entry = self._entries.get(block)
        return None if entry is None else entry.block_hash

    def forget(self, block: int) -> None:
        """Drop an evicted block from the index."""
        entry = self._entries.pop(block)
        del self._index[entry.block_hash]

    def check_integrity(self, hash_fn: HashFn, cached_blocks: set[int]) -> None:
        """AssertionError unless index, entries and the pool's cached blocks agree."""
        assert len(self._index) == len(self._entries), "hash index and entries differ in size"
        assert set(self._entries) == cached_blocks, (
            f"published blocks {sorted(self._entries)} != pool cached {sorted(cached_blocks)}"
        )
        for block_hash, block in self._index.items():
            entry = self._entries[block]
            assert entry.block_hash == block_hash, f"block {block} indexed under a foreign hash"
            recomputed = hash_fn(entry.parent_hash, entry.tokens, entry.extra_key)
            assert recomputed == block_hash, f"block {block}: hash does not match its tokens"
