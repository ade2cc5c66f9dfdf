"""`BlockManager`: block tables, copy-on-write fork and the prefix cache over one `BlockPool`.

The scheduler's façade; it speaks integers only. Per sequence it keeps the block table, the
number of token slots covered (`num_tokens`, set by `allocate`) and how many leading full
blocks are committed to the prefix cache. Every call costs O(blocks it changes).

Contracts:
- `lookup_prefix` (optional) comes first for a new sequence; `allocate` grows tables, which
  never shrink; `free` releases a table tail first, so tails are evicted first. A lookup counts
  in `metrics` once its sequence's first `allocate` succeeds (an admission that found no room
  counts nothing).
- Refused input (a token id that does not fit 64 bits, a `num_tokens` that is not a
  non-negative int) raises ValueError naming the field and changes nothing.
- A swapped-out sequence keeps its id until `swap_in` (or `free`): `lookup_prefix`,
  `allocate` and `fork` refuse to create a table under it (SequenceExistsError).
- `num_tokens` counts the slots the sequence has written or writes in the step being planned.
  `allocate` beyond a partly filled last block with ref count > 1 (after `fork`) moves the
  sequence onto a private copy and reports `(src, dst)`; the runner copies before writing.
- Admission `"slru"`: a published block starts probationary and is promoted to the protected
  segment when a second request hits it (`lookup_prefix(promote=False)` for a request hitting
  its own blocks again); eviction takes probationary blocks first, so a flood of one-off
  prompts cannot push out a hot shared prefix. `"lru"`: plain LRU, no promotion.
- A swapped-in sequence walks its chain again from its first block at the next `commit`: its
  fresh blocks are published where their earlier publications were evicted meanwhile.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

from kvmesh.memory.block_pool import BlockPool
from kvmesh.memory.errors import CapacityError, SequenceExistsError, UnknownSequenceError
from kvmesh.memory.hashing import BlockHasher, DigestFn, HashFn, chain_hashes
from kvmesh.memory.metrics import MemoryMetrics
from kvmesh.memory.prefix_cache import BlockRef, PrefixCache
from kvmesh.memory.tier_link import TierLink

if TYPE_CHECKING:
    from kvmesh.memory.tiers.store import TieredStore

ADMISSION_POLICIES = ("slru", "lru")
_new_result = tuple.__new__  # _new_result(AllocResult, (new, pairs)): no Python-level __new__


class AllocResult(NamedTuple):
    """Blocks newly placed in the table (table order) and (src, dst) copies to run first."""

    new_blocks: list[int]
    copy_pairs: list[tuple[int, int]]


@dataclass(slots=True)
class _Seq:
    blocks: list[int] = field(default_factory=list)
    num_tokens: int = 0
    num_committed: int = 0  # leading full blocks whose chain hash is known
    last_hash: int | None = None  # chain hash of block num_committed - 1
    last_ref: BlockRef | None = None  # cached entry holding block num_committed - 1
    chain_broken: bool = False  # a true hash collision: publish nothing further
    last_digest: bytes | None = None  # prefix digest of block num_committed - 1 (with tiers)
    lookup: tuple[int, int] | None = None  # (query, hit tokens) not yet in the metrics


class BlockManager:
    """Paged KV block tables with prefix caching; see the module docstring for contracts."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        enable_prefix_caching: bool = True,
        hash_seed: bytes | None = None,
        admission: str = "slru",
        protected_fraction: float = 0.5,
        hash_fn: HashFn | None = None,
        tiers: TieredStore | None = None,
    ) -> None:
        if admission not in ADMISSION_POLICIES:
            raise ValueError(f"admission must be one of {ADMISSION_POLICIES}, got {admission!r}")
        if not 0.0 <= protected_fraction <= 1.0:
            raise ValueError(f"protected_fraction must be in [0, 1], got {protected_fraction}")
        self._cache = PrefixCache()
        self._pool = BlockPool(
            num_blocks, block_size, protected_capacity=int(num_blocks * protected_fraction)
        )
        self._pool.on_evict = self._cache.forget
        self._cache.on_orphan = self._drop_orphan
        self._bs = block_size
        hasher = BlockHasher(hash_seed)
        self._hash: HashFn = hash_fn or hasher.hash_block
        self.tiers = tiers
        self._digest: DigestFn | None = None  # prefix digests: what a tier hit is checked by
        self._link = None
        if tiers is not None:
            self._digest = hasher.digest_block
            self._link = TierLink(tiers, self._pool, self._cache, self._hash, self._digest)
            self._pool.on_evict = self._link.evicted
        self._promote_on_hit = admission == "slru"
        self.admission = admission
        self.enable_prefix_caching = enable_prefix_caching
        self._seqs: dict[str, _Seq] = {}
        self._swapped: dict[str, _Seq] = {}  # swapped out to the host tier
        self._queries = self._query_tokens = self._hit_tokens = self._cow_copies = 0

    # -- properties --------------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return self._pool.num_blocks

    @property
    def block_size(self) -> int:
        return self._bs

    @property
    def num_free_blocks(self) -> int:
        """Blocks allocatable now: free plus evictable cached blocks."""
        return self._pool.num_free

    def has(self, seq_id: str) -> bool:
        return seq_id in self._seqs

    def num_tokens(self, seq_id: str) -> int:
        return self._get(seq_id).num_tokens

    def block_table(self, seq_id: str) -> list[int]:
        return list(self._get(seq_id).blocks)

    def ref_count(self, block_id: int) -> int:
        return self._pool.ref_count(block_id)

    def slot_mapping(self, seq_id: str, start: int, end: int) -> list[int]:
        """Cache slot (block_id * block_size + offset) of each token position in [start, end)."""
        blocks, bs = self._get(seq_id).blocks, self._bs
        if not 0 <= start <= end <= len(blocks) * bs:
            raise ValueError(
                f"start/end must satisfy 0 <= start <= end <= {len(blocks) * bs}"
                f" (allocated slots of {seq_id!r}), got start={start}, end={end}"
            )
        if end - start == 1:
            return [blocks[start // bs] * bs + start % bs]
        return [blocks[pos // bs] * bs + pos % bs for pos in range(start, end)]

    def block_hashes(self, token_ids: Sequence[int], extra_key: bytes | None = None) -> list[int]:
        """Chain hashes of the full blocks of `token_ids`: the cache keys, which another
        process computes alike only under the same `hash_seed`."""
        return chain_hashes(self._hash, token_ids, self._bs, extra_key)

    # -- sequence lifecycle ------------------------------------------------------------------
    def lookup_prefix(
        self,
        seq_id: str,
        token_ids: Sequence[int],
        extra_key: bytes | None = None,
        *,
        promote: bool = True,
    ) -> int:
        """Create `seq_id` holding the longest cached run of full prompt blocks; return its tokens.

        At least one prompt token is left to compute. Hit blocks gain a reference each; under
        SLRU, `promote` moves them to the protected segment (False for a sequence hitting its
        own blocks again: re-admitted after a recompute preemption).
        """
        if seq_id in self._seqs:
            raise SequenceExistsError(f"seq_id {seq_id!r} already exists (lookup_prefix is first)")
        self._check_not_swapped(seq_id)
        seq = _Seq()
        if self.enable_prefix_caching:
            self._attach_prefix(seq, token_ids, extra_key or None, promote)
        seq.lookup = (len(token_ids), seq.num_tokens)
        self._seqs[seq_id] = seq
        return seq.num_tokens

    def _attach_prefix(
        self, seq: _Seq, token_ids: Sequence[int], extra_key: bytes | None, promote: bool
    ) -> None:
        """Give a new `seq` the cached blocks of the prompt's longest cached prefix, on the
        device and then in the tiers. Everything that can raise (hashing) runs first."""
        bs, link = self._bs, self._link
        prompt = token_ids[: max(0, len(token_ids) - 1) // bs * bs]
        refs, parent_hash = self._match_device(prompt, extra_key)
        parent_ref = refs[-1] if refs else None
        found = link.find(prompt, len(refs), bs, extra_key, parent_hash, parent_ref) if link else []
        protect = self._promote_on_hit and promote
        for block, _ in refs:
            self._pool.incref(block)
            if protect:
                self._pool.protect(block)
        seq.blocks = [block for block, _ in refs]
        if link is not None and found:
            parent_hash, parent_ref = link.reload(seq.blocks, found, parent_ref)
        seq.num_tokens = len(seq.blocks) * bs
        seq.num_committed = len(seq.blocks)
        seq.last_hash, seq.last_ref = parent_hash, parent_ref
        if self._digest is not None:
            seq.last_digest = self._cache.digest_of(parent_ref)

    def _match_device(
        self, prompt: Sequence[int], extra_key: bytes | None
    ) -> tuple[list[BlockRef], int | None]:
        """The cached blocks matching `prompt`'s leading full blocks and the last one's hash;
        reads only (ValueError for a token that does not fit 64 bits)."""
        bs, match = self._bs, self._cache.match
        refs: list[BlockRef] = []
        parent_hash: int | None = None
        parent_ref: BlockRef | None = None
        for start in range(0, len(prompt), bs):
            tokens = prompt[start : start + bs]
            block_hash = self._hash(parent_hash, tokens, extra_key)
            ref = match(block_hash, parent_hash, parent_ref, tokens, extra_key)
            if ref is None:
                break
            refs.append(ref)
            parent_hash, parent_ref = block_hash, ref
        return refs, parent_hash

    def evict_all(self) -> None:
        """Evict every unreferenced cached block (each spills to the tiers, if any): what a
        persistent disk tier needs at shutdown."""
        taken = self._take_blocks(self._pool.num_free)
        for block in taken or ():
            self._pool.decref(block)

    def allocate(self, seq_id: str, num_tokens: int) -> AllocResult | None:
        """Cover `num_tokens` slots in total (creating the seq if new); None if blocks run out.

        All-or-nothing: on None nothing changed. A `num_tokens` at or below the current count
        is a no-op. Raises CapacityError when the whole pool could never hold `num_tokens`.
        """
        if not isinstance(num_tokens, int) or num_tokens < 0:
            raise ValueError(f"num_tokens must be a non-negative int, got {num_tokens!r}")
        seq = self._seqs.get(seq_id)
        if seq is None:
            return self._open(seq_id, num_tokens)
        if seq.lookup is not None:
            return self._admit(seq_id, seq, num_tokens)
        if num_tokens <= seq.num_tokens:
            return _new_result(AllocResult, ([], []))
        bs = self._bs
        blocks_needed = -(-num_tokens // bs)
        grow = blocks_needed - len(seq.blocks)
        cow = seq.num_tokens % bs != 0 and self._pool.ref_count(seq.blocks[-1]) > 1
        if grow <= 0 and not cow:
            seq.num_tokens = num_tokens
            return _new_result(AllocResult, ([], []))
        return self._grow(seq, num_tokens, blocks_needed, grow + cow, cow)

    def _open(self, seq_id: str, num_tokens: int) -> AllocResult | None:
        """`allocate` for a sequence not tracked yet."""
        self._check_not_swapped(seq_id)
        blocks_needed = -(-num_tokens // self._bs)
        self._check_capacity(num_tokens, blocks_needed)
        new = self._take_blocks(blocks_needed)
        if new is None:
            return None
        self._seqs[seq_id] = _Seq(list(new), num_tokens)
        return _new_result(AllocResult, (new, []))

    def _admit(self, seq_id: str, seq: _Seq, num_tokens: int) -> AllocResult | None:
        """The first `allocate` after `lookup_prefix`: on success the lookup counts in the
        metrics (an admission that found no room counts nothing)."""
        assert seq.lookup is not None
        (query_tokens, hit_tokens), seq.lookup = seq.lookup, None
        result = self.allocate(seq_id, num_tokens)
        if result is None:
            seq.lookup = (query_tokens, hit_tokens)
            return None
        self._queries += 1
        self._query_tokens += query_tokens
        self._hit_tokens += hit_tokens
        return result

    def _grow(
        self, seq: _Seq, num_tokens: int, blocks_needed: int, count: int, cow: bool
    ) -> AllocResult | None:
        """Take `count` new blocks for `seq` (the first one a private copy of its shared
        partial last block when `cow`) to cover `num_tokens`; None (nothing changed) if short."""
        self._check_capacity(num_tokens, blocks_needed)
        new = self._take_blocks(count)
        if new is None:
            return None
        blocks = seq.blocks
        pairs: list[tuple[int, int]] = []
        if cow:
            src, dst = blocks[-1], new[0]
            blocks[-1] = dst
            self._pool.decref(src)
            pairs.append((src, dst))
            self._cow_copies += 1
            blocks.extend(new[1:])
        else:
            blocks.extend(new)
        seq.num_tokens = num_tokens
        return _new_result(AllocResult, (new, pairs))

    def _take_blocks(self, count: int) -> list[int] | None:
        """Pool allocation; blocks it evicted are copied to the tiers before it returns."""
        new = self._pool.allocate(count)
        if self.tiers is not None:
            self.tiers.flush_spills()
        return new

    def _check_not_swapped(self, seq_id: str) -> None:
        """SequenceExistsError when `seq_id` is swapped out: a second table under its id would
        outlive `free` (which drops the swapped copy) and hold its blocks forever."""
        if seq_id in self._swapped:
            raise SequenceExistsError(
                f"seq_id {seq_id!r} is swapped out; swap_in brings its table back"
            )

    def _check_capacity(self, num_tokens: int, blocks_needed: int) -> None:
        if blocks_needed > self._pool.num_blocks:
            raise CapacityError(
                f"num_tokens={num_tokens} needs {blocks_needed} blocks of {self._bs} slots,"
                f" but the pool has only {self._pool.num_blocks} blocks"
                f" ({self._pool.num_blocks * self._bs} slots)"
            )

    def commit(
        self,
        seq_id: str,
        token_ids: Sequence[int],
        num_computed: int,
        extra_key: bytes | None = None,
    ) -> None:
        """Publish the full blocks among the first `num_computed` tokens (KV computed).

        Idempotent; O(newly full blocks), each hashed once from its parent's hash. The
        computed tokens were written, so `num_tokens` rises to `num_computed` if it trailed
        (allowed within the blocks the sequence holds). A block identical to one already
        cached under another id stays unpublished (it is freed normally, the cached copy
        serves hits); an orphan holding its hash (its parent publication gone, so no lookup
        reaches it) is replaced.
        """
        seq = self._get(seq_id)
        if not 0 <= num_computed <= len(token_ids) or num_computed > len(seq.blocks) * self._bs:
            raise ValueError(
                f"num_computed must be in [0, min(len(token_ids)={len(token_ids)},"
                f" allocated slots={len(seq.blocks) * self._bs})], got {num_computed}"
            )
        if num_computed > seq.num_tokens:
            seq.num_tokens = num_computed
        if not self.enable_prefix_caching:
            return
        full = num_computed // self._bs
        if full <= seq.num_committed:
            return
        if not seq.chain_broken:
            self._publish_blocks(seq, token_ids, full, extra_key or None)
        seq.num_committed = full

    def _publish_blocks(
        self, seq: _Seq, token_ids: Sequence[int], full: int, extra_key: bytes | None
    ) -> None:
        bs, parent_hash, parent_ref = self._bs, seq.last_hash, seq.last_ref
        commit_block, blocks, digest_fn = self._cache.commit_block, seq.blocks, self._digest
        digest = seq.last_digest
        for index in range(seq.num_committed, full):
            tokens = tuple(token_ids[index * bs : (index + 1) * bs])
            block_hash = self._hash(parent_hash, tokens, extra_key)
            if digest_fn is not None:
                digest = digest_fn(digest, tokens, extra_key)
            block = blocks[index]
            ref, is_new = commit_block(
                block, block_hash, parent_hash, parent_ref, tokens, extra_key, digest
            )
            if is_new:
                self._pool.mark_cached(block)
                if self.tiers is not None:
                    self.tiers.discard(block_hash)
            if ref is None:
                seq.chain_broken = True
                return
            parent_hash, parent_ref = block_hash, ref
        seq.last_hash, seq.last_ref, seq.last_digest = parent_hash, parent_ref, digest

    def _drop_orphan(self, block: int) -> None:
        """The prefix cache replaces the orphan `block` (a block of its hash is published on
        the device at once, so it is not spilled): uncached, and unreferenced, it goes free
        without any copy still queued into it."""
        if self.tiers is not None and not self._pool.ref_count(block):
            self.tiers.drop_reloads([block])
        self._pool.uncache(block)

    def fork(self, parent_id: str, child_id: str) -> None:
        """`child_id` shares every block of `parent_id` (ref +1 each); writes then copy on write."""
        parent = self._get(parent_id)
        if child_id in self._seqs or child_id in self._swapped:
            raise SequenceExistsError(f"child_id {child_id!r} already exists")
        for block in parent.blocks:
            self._pool.incref(block)
        self._seqs[child_id] = _Seq(
            list(parent.blocks),
            parent.num_tokens,
            parent.num_committed,
            parent.last_hash,
            parent.last_ref,
            parent.chain_broken,
            parent.last_digest,
        )

    def swap_out(self, seq_id: str) -> bool:
        """Copy the sequence's blocks to the host tier, then release them (as `free`); its
        table comes back with `swap_in`. False (nothing changed) when the host has no room."""
        seq = self._get(seq_id)
        if self.tiers is None or not self.tiers.swap_out(seq_id, seq.blocks):
            return False
        self.free(seq_id)
        self._swapped[seq_id] = seq
        return True

    def is_swapped(self, seq_id: str) -> bool:
        return seq_id in self._swapped

    def swap_in(self, seq_id: str) -> bool:
        """Give a swapped-out sequence fresh blocks; the tiers copy its KV in before the next
        step. False (nothing changed) when blocks run out."""
        seq = self._swapped[seq_id]
        new = self._take_blocks(len(seq.blocks))
        if new is None:
            return False
        assert self.tiers is not None
        self.tiers.swap_in(seq_id, new)
        seq.blocks = new
        # its old publications may be gone: the next commit walks the chain from the start
        seq.num_committed, seq.last_hash, seq.last_ref, seq.last_digest = 0, None, None, None
        seq.chain_broken = False
        self._seqs[seq_id] = self._swapped.pop(seq_id)
        return True

    def free(self, seq_id: str) -> None:
        """Release the sequence's blocks tail first; cached ones become evictable, others free."""
        if seq_id in self._swapped:
            del self._swapped[seq_id]
            assert self.tiers is not None
            self.tiers.drop_swapped(seq_id)
            return
        seq = self._seqs.pop(seq_id, None)
        if seq is None:
            raise UnknownSequenceError(f"seq_id {seq_id!r} is not tracked")
        if self.tiers is not None:  # a copy still queued into a block going free is dead
            pool = self._pool
            self.tiers.drop_reloads(
                [b for b in seq.blocks if pool.ref_count(b) == 1 and not pool.is_cached(b)]
            )
        for block in reversed(seq.blocks):
            self._pool.decref(block)

    def _get(self, seq_id: str) -> _Seq:
        seq = self._seqs.get(seq_id)
        if seq is None:
            raise UnknownSequenceError(f"seq_id {seq_id!r} is not tracked")
        return seq

    # -- observability -----------------------------------------------------------------------
    def metrics(self) -> MemoryMetrics:
        pool = self._pool
        total, free_now = pool.num_blocks, pool.num_free
        return MemoryMetrics(
            total_blocks=total,
            free_blocks=free_now - pool.num_evictable,
            evictable_blocks=pool.num_evictable,
            protected_blocks=pool.num_evictable_protected,
            in_use_blocks=total - free_now,
            usage=(total - free_now) / total,
            cached_blocks=len(self._cache),
            prefix_queries=self._queries,
            prefix_query_tokens=self._query_tokens,
            prefix_hit_tokens=self._hit_tokens,
            prefix_hit_rate=self._hit_tokens / self._query_tokens if self._query_tokens else 0.0,
            evictions=pool.num_evictions,
            cow_copies=self._cow_copies,
            hash_collisions=self._cache.num_collisions,
        )

    def check_integrity(self) -> None:
        """AssertionError naming the broken invariant (tables, ref counts, queues, hash index)."""
        both = self._seqs.keys() & self._swapped.keys()
        assert not both, f"{sorted(both)}: a live table and a swapped-out copy under one id"
        refs: list[int] = []
        for seq_id, seq in self._seqs.items():
            assert len(seq.blocks) == -(-seq.num_tokens // self._bs), (
                f"{seq_id!r}: {len(seq.blocks)} blocks for {seq.num_tokens} tokens"
            )
            assert seq.num_committed <= len(seq.blocks), f"{seq_id!r}: committed past its table"
            refs.extend(seq.blocks)
        self._pool.check_integrity(refs)
        cached = {b for b in range(self._pool.num_blocks) if self._pool.is_cached(b)}
        self._cache.check_integrity(self._hash, cached, self._digest)
        if self.tiers is not None:
            self.tiers.check_integrity(self._cache.hashes(), set(self._swapped))
