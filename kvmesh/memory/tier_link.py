"""How the block manager reaches the KV tiers below its pool (`kvmesh.memory.tiers`).

`TierLink` holds the manager's pool, prefix cache, hash and digest functions next to a
TieredStore and does the things that cross the boundary: a cached block evicted from the pool
spills down (`evicted`), and a prefix lookup continues into the tiers once the device has no
more hits (`find`, which only reads, then `reload`); the allocations it makes flush their
spills before returning. A lower copy is served only when its prefix digest is the lookup's
own: below the device no parent publication can be checked, and the digest stands for the
whole prefix, so a forced hash collision is a miss there too. Pure Python: the store (which
holds the tensors) is only called.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvmesh.memory.block_pool import BlockPool
from kvmesh.memory.hashing import DigestFn, HashFn
from kvmesh.memory.prefix_cache import BlockRef, PrefixCache
from kvmesh.memory.tiers.blockfile import BlockMeta

if TYPE_CHECKING:
    from kvmesh.memory.tiers.store import TieredStore


class TierLink:
    def __init__(
        self,
        tiers: TieredStore,
        pool: BlockPool,
        cache: PrefixCache,
        hash_fn: HashFn,
        digest_fn: DigestFn,
    ) -> None:
        self.tiers, self._pool, self._cache = tiers, pool, cache
        self._hash, self._digest = hash_fn, digest_fn

    def evicted(self, block: int) -> None:
        """The pool evicts a cached block: forget it on the device, spill it down."""
        entry = self._cache.forget(block)
        assert entry.digest is not None, "a block published beside tiers has a prefix digest"
        meta = BlockMeta(
            entry.block_hash, entry.parent_hash, entry.tokens, entry.extra_key, entry.digest
        )
        self.tiers.spill(block, meta)

    def find(
        self,
        prompt: Sequence[int],
        start: int,
        block_size: int,
        extra_key: bytes | None,
        parent_hash: int | None,
        parent_ref: BlockRef | None,
    ) -> list[BlockMeta]:
        """What the full blocks of `prompt` from block `start` on must be to continue the
        device hit ending at `parent_ref` (hash `parent_hash`), for as long as a lower tier
        holds their hashes. Reads only (ValueError for a token that does not fit 64 bits)."""
        tiers, bs = self.tiers, block_size
        digest = self._cache.digest_of(parent_ref)
        found: list[BlockMeta] = []
        for begin in range(start * bs, len(prompt) // bs * bs, bs):
            tokens = tuple(prompt[begin : begin + bs])
            block_hash = self._hash(parent_hash, tokens, extra_key)
            if not tiers.contains(block_hash) or block_hash in self._cache:
                break
            digest = self._digest(digest, tokens, extra_key)
            found.append(BlockMeta(block_hash, parent_hash, tokens, extra_key, digest))
            parent_hash = block_hash
        return found

    def reload(
        self, blocks: list[int], found: list[BlockMeta], parent_ref: BlockRef | None
    ) -> tuple[int | None, BlockRef | None]:
        """Extend a device hit (`blocks`, ending at `parent_ref`) with the blocks `find` named,
        in order, while the pool has room and a tier holds exactly that block: each gets a
        fresh device block, published at once, whose KV the tiers copy in before the next
        step. Returns the new chain end (hash, ref)."""
        tiers, pool = self.tiers, self._pool
        parent_hash = found[0].parent_hash
        for meta in found:
            new = pool.allocate(1)
            tiers.flush_spills()  # the eviction above must copy out before the reload lands
            if new is None:
                break
            if not tiers.take(meta, new[0]):
                pool.decref(new[0])
                break
            ref, _ = self._cache.commit_block(
                new[0],
                meta.block_hash,
                meta.parent_hash,
                parent_ref,
                meta.tokens,
                meta.extra_key,
                meta.digest,
            )
            assert ref is not None and ref[0] == new[0], "a reloaded hash was cached twice"
            pool.mark_cached(new[0])
            blocks.append(new[0])
            parent_hash, parent_ref = meta.block_hash, ref
        return parent_hash, parent_ref
