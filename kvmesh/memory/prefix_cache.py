"""Prefix-cache index: block hash -> block id, verified on every hit.

A hit must match the block's token ids, extra key and *parent publication*: each published
block records the exact (block id, publication number) of the cached block before it in its
chain, and a lookup only follows a block whose parent is the block it matched one step
earlier. So even forced hash collisions can never serve KV computed under another context.

Only full blocks whose KV is computed are published. One block per hash: if an identical block
is already cached under another id, the newcomer stays unpublished (it frees normally) and its
chain continues from the cached twin.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from kvmesh.memory.hashing import HashFn

BlockRef = tuple[int, int]  # (block id, publication number): one publication of one block
_new_entry = tuple.__new__  # _new_entry(CachedBlock, fields): no Python-level __new__


class CachedBlock(NamedTuple):
    """What a published block holds: its chain position and exact contents."""

    block_hash: int
    parent_hash: int | None
    parent_ref: BlockRef | None
    tokens: tuple[int, ...]
    extra_key: bytes | None
    ref: BlockRef


class PrefixCache:
    """Maps chained block hashes to cached blocks; O(1) per operation (plus the token compare)."""

    def __init__(self) -> None:
        self._index: dict[int, int] = {}
        self._entries: dict[int, CachedBlock] = {}
        self._publications = 0
        self.num_collisions = 0

    def __len__(self) -> int:
        return len(self._index)

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self._index

    def hashes(self) -> set[int]:
        return set(self._index)

    def match(
        self,
        block_hash: int,
        parent_ref: BlockRef | None,
        tokens: Sequence[int],
        extra_key: bytes | None,
        *,
        count_collision: bool = True,
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
            self.num_collisions += count_collision
            return None
        return entry.ref

    def commit_block(
        self,
        block: int,
        block_hash: int,
        parent_hash: int | None,
        parent_ref: BlockRef | None,
        tokens: tuple[int, ...],
        extra_key: bytes | None,
    ) -> tuple[BlockRef | None, bool]:
        """Publish `block` unless its hash is taken: (ref of the entry now holding this
        content, newly published?). An identical block cached under another id is reused (its
        twin); on a true hash collision the ref is None and nothing changed.
        """
        entry = self._entries.get(block)
        if entry is not None:
            if (entry.block_hash, entry.tokens, entry.extra_key) != (block_hash, tokens, extra_key):
                raise ValueError(f"token_ids disagree with the tokens committed to block {block}")
            return entry.ref, False
        if block_hash in self._index:
            twin = self.match(block_hash, parent_ref, tokens, extra_key, count_collision=False)
            return twin, False
        self._publications += 1
        ref = (block, self._publications)
        self._index[block_hash] = block
        self._entries[block] = _new_entry(
            CachedBlock, (block_hash, parent_hash, parent_ref, tokens, extra_key, ref)
        )
        return ref, True

    def forget(self, block: int) -> CachedBlock:
        """Drop an evicted block from the index; return what it held."""
        entry = self._entries.pop(block)
        del self._index[entry.block_hash]
        return entry

    def check_integrity(self, hash_fn: HashFn, cached_blocks: set[int]) -> None:
        """AssertionError unless index, entries and the pool's cached blocks agree."""
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
