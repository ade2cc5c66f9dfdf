"""How the block manager reaches the KV tiers below its pool (`kvmesh.memory.tiers`).

`TierLink` holds the manager's pool, prefix cache and hash function next to a TieredStore
and does the three things that cross the boundary: a cached block evicted from the pool spills
down (`evicted`), a prefix lookup continues into the tiers once the device has no more hits
(`reload_prefix`), and the allocations it makes flush their spills before returning. Pure
Python: the store (which holds the tensors) is only called.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvmesh.memory.block_pool import BlockPool
from kvmesh.memory.hashing import HashFn
from kvmesh.memory.prefix_cache import BlockRef, PrefixCache
from kvmesh.memory.tiers.blockfile import BlockMeta

if TYPE_CHECKING:
    from kvmesh.memory.tiers.store import TieredStore


class TierLink:
    def __init__(
        self, tiers: TieredStore, pool: BlockPool, cache: PrefixCache, hash_fn: HashFn
    ) -> None:
        self.tiers, self._pool, self._cache, self._hash = tiers, pool, cache, hash_fn

    def evicted(self, block: int) -> None:
        """The pool evicts a cached block: forget it on the device, spill it down."""
        entry = self._cache.forget(block)
        meta = BlockMeta(entry.block_hash, entry.parent_hash, entry.tokens, entry.extra_key)
        self.tiers.spill(block, meta)

    def reload_prefix(
        self,
        blocks: list[int],
        token_ids: Sequence[int],
        block_size: int,
        extra_key: bytes | None,
        parent: tuple[int | None, BlockRef | None],
    ) -> tuple[int | None, BlockRef | None]:
        """Extend a device hit (`blocks`, ending at `parent` = (hash, ref)) with the blocks of
        `token_ids` found in the tiers: each gets a fresh device block, published at once,
        whose KV the tiers copy in before the next step. Returns the new chain end."""
        tiers, bs = self.tiers, block_size
        parent_hash, parent_ref = parent
        for start in range(len(blocks) * bs, len(token_ids) // bs * bs, bs):
            tokens = tuple(token_ids[start : start + bs])
            block_hash = self._hash(parent_hash, tokens, extra_key)
            if not tiers.contains(block_hash) or block_hash in self._cache:
                break
            new = self._pool.allocate(1)
            tiers.flush_spills()  # the eviction above must copy out before the reload lands
            if new is None:
                break
            if not tiers.take(BlockMeta(block_hash, parent_hash, tokens, extra_key), new[0]):
                self._pool.decref(new[0])
                break
            ref, _ = self._cache.commit_block(
                new[0], block_hash, parent_hash, parent_ref, tokens, extra_key
            )
            assert ref is not None and ref[0] == new[0], "a reloaded hash was cached twice"
            self._pool.mark_cached(new[0])
            blocks.append(new[0])
            parent_hash, parent_ref = block_hash, ref
        return parent_hash, parent_ref
