"""Prefix-cache index: block hash -> block id, verified on every hit.

A hit must match the block's token ids, extra key and *parent publication*: each published
block records the exact (block id, publication number) of the cached block before it in its
chain, and a lookup only follows a block whose parent is the block it matched one step
earlier. So even forced hash collisions can never serve KV computed under another context.

Only full blocks whose KV is computed are published. One block per hash: if an identical block
is already cached under another id, the newcomer stays unpublished (it frees normally) and its
chain continues from the cached twin. A cached block whose parent publication is gone (evicted
before it, as a twin's parent may be while the chain continued from it) is an orphan: no
lookup can reach it, so a block of the same hash committed under a live parent replaces it
(`on_orphan` uncaches it first). A lookup counts a hash collision only when the hash inputs
(parent hash, tokens, extra key) differ.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

from kvmesh.memory.hashing import DigestFn, HashFn

BlockRef = tuple[int, int]  # (block id, publication number): one publication of one block
_new_entry = tuple.__new__  # _new_entry(CachedBlock, fields): no Python-level __new__


class CachedBlock(NamedTuple):
    """What a published block holds: its chain position and exact contents."""

    block_hash: int
    parent_hash: int | None
    parent_ref: BlockRef | None
    tokens: tuple[int, ...]
    extra_key: bytes | None
    digest: bytes | None  # prefix digest (`BlockHasher.digest_block`); None without tiers
    ref: BlockRef


class PrefixCache:
    """Maps chained block hashes to cached blocks; O(1) per operation (plus the token compare)."""

    def __init__(self) -> None:
        self._index: dict[int, int] = {}
        self._entries: dict[int, CachedBlock] = {}
        self._publications = 0
        self.num_collisions = 0
        self.on_orphan: Callable[[int], object] | None = None  # an orphan is being replaced

    def __len__(self) -> int:
        return len(self._index)

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self._index

    def hashes(self) -> set[int]:
        return set(self._index)

    def match(
        self,
        block_hash: int,
        parent_hash: int | None,
        parent_ref: BlockRef | None,
        tokens: Sequence[int],
        extra_key: bytes | None,
    ) -> BlockRef | None:
        """The cached block holding exactly this block after `parent_ref`, or None."""
        block = self._index.get(block_hash)
        if block is None:
            return None
        entry = self._entries[block]
        if (
            entry.parent_ref != parent_ref
            or entry.extra_key != extra_key
            or entry.tokens != tuple(tokens)
        ):
            self._count_collision(entry, parent_hash, tokens, extra_key)
            return None
        return entry.ref

    def digest_of(self, ref: BlockRef | None) -> bytes | None:
        """The prefix digest of the live publication `ref` (None for the chain's root)."""
        return None if ref is None else self._entries[ref[0]].digest

    def commit_block(
        self,
        block: int,
        block_hash: int,
        parent_hash: int | None,
        parent_ref: BlockRef | None,
        tokens: tuple[int, ...],
        extra_key: bytes | None,
        digest: bytes | None = None,
    ) -> tuple[BlockRef | None, bool]:
        """Publish `block` unless its hash is taken: (ref of the entry now holding this
        content, newly published?). An identical block cached under another id after the same
        parent is reused (its twin); an orphan holding the hash is replaced when `parent_ref` is
        live; otherwise (a collision, or a parent no longer live) the ref is None and nothing
        changed.
        """
        entry = self._entries.get(block)
        if entry is not None:
            if (entry.block_hash, entry.tokens, entry.extra_key) != (block_hash, tokens, extra_key):
                raise ValueError(f"token_ids disagree with the tokens committed to block {block}")
            return entry.ref, False
        holder = self._index.get(block_hash)
        if holder is not None:
            held = self._entries[holder]
            if (held.parent_ref, held.tokens, held.extra_key) == (parent_ref, tokens, extra_key):
                return held.ref, False
            if self._is_live(held.parent_ref) or not self._is_live(parent_ref):
                return None, False
            self._drop_orphan(holder)
        self._publications += 1
        ref = (block, self._publications)
        self._index[block_hash] = block
        self._entries[block] = _new_entry(
            CachedBlock, (block_hash, parent_hash, parent_ref, tokens, extra_key, digest, ref)
        )
        return ref, True

    def _count_collision(
        self,
        entry: CachedBlock,
        parent_hash: int | None,
        tokens: Sequence[int],
        extra_key: bytes | None,
    ) -> None:
        """Count a true hash collision: `entry` hashes alike from other hash inputs."""
        if (entry.parent_hash, entry.extra_key, entry.tokens) != (
            parent_hash,
            extra_key,
            tuple(tokens),
        ):
            self.num_collisions += 1

    def _is_live(self, ref: BlockRef | None) -> bool:
        """Whether `ref` (None: the chain's root) is a publication still in the index."""
        if ref is None:
            return True
        entry = self._entries.get(ref[0])
        return entry is not None and entry.ref == ref

    def _drop_orphan(self, block: int) -> None:
        if self.on_orphan is not None:
            self.on_orphan(block)
        self.forget(block)

    def forget(self, block: int) -> CachedBlock:
        """Drop an evicted block from the index; return what it held."""
        entry = self._entries.pop(block)
        del self._index[entry.block_hash]
        return entry

    def check_integrity(
        self, hash_fn: HashFn, cached_blocks: set[int], digest_fn: DigestFn | None = None
    ) -> None:
        """AssertionError unless index, entries and the pool's cached blocks agree (and, given
        `digest_fn`, each digest follows from its live parent's)."""
        assert len(self._index) == len(self._entries), "hash index and entries differ in size"
        assert set(self._entries) == cached_blocks, (
            f"published blocks {sorted(self._entries)} != pool cached {sorted(cached_blocks)}"
        )
        for block_hash, block in self._index.items():
            entry = self._entries[block]
            assert entry.block_hash == block_hash, f"block {block} indexed under a foreign hash"
            assert entry.ref[0] == block, f"block {block} carries the ref of {entry.ref[0]}"
            recomputed = hash_fn(entry.parent_hash, entry.tokens, entry.extra_key)
            assert recomputed == block_hash, f"block {block}: hash does not match its tokens"
            if digest_fn is not None and self._is_live(entry.parent_ref):
                digest = digest_fn(self.digest_of(entry.parent_ref), entry.tokens, entry.extra_key)
                assert digest == entry.digest, f"block {block}: digest does not follow its parent's"
