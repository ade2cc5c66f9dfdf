"""Chained, per-process-seeded hashes of full KV blocks (the prefix-cache key).

h_i = XXH3-128(seed, h_{i-1} || len(extra_key) || extra_key || token ids of block i)

The seed is random per process unless given, so no client can precompute colliding prompts;
`extra_key` (an adapter id or a tenant salt) separates caches that must never share KV. Hits
are still verified against the stored token ids, so even a collision is never served.

d_i = BLAKE2b-256(key = BLAKE2b(seed), d_{i-1} || len(extra_key) || extra_key || tokens of block i)

is the prefix digest: collision-resistant over the whole prefix, so a block kept below the
device (where no parent publication can be checked) is served only for exactly its prefix.
"""

from __future__ import annotations

import hashlib
import os
import struct
from collections.abc import Callable, Sequence
from functools import lru_cache

import xxhash

# (parent_hash or None, token ids of one full block, extra_key) -> block hash
HashFn = Callable[[int | None, Sequence[int], bytes | None], int]
# (parent digest or None, token ids of one full block, extra_key) -> prefix digest
DigestFn = Callable[[bytes | None, Sequence[int], bytes | None], bytes]

_PROCESS_SEED: bytes = os.urandom(16)
_NO_PARENT = b"\x00" * 16
_NO_PARENT_NO_KEY = b"\x00" * 20
DIGEST_BYTES = 32
_NO_DIGEST = b"\x00" * DIGEST_BYTES
_BAD_TOKENS = "token_ids must be integers that fit in 64 bits (signed)"


@lru_cache(maxsize=64)
def _packer(count: int) -> struct.Struct:
    return struct.Struct(f"<{count}q")


def _pack(tokens: Sequence[int]) -> bytes:
    """The token ids as little-endian int64s; ValueError naming token_ids otherwise."""
    try:
        return _packer(len(tokens)).pack(*tokens)
    except struct.error as exc:
        raise ValueError(_BAD_TOKENS) from exc


def chain_hashes(
    hash_fn: HashFn,
    token_ids: Sequence[int],
    block_size: int,
    extra_key: bytes | None = None,
    *,
    max_blocks: int | None = None,
) -> list[int]:
    """Chained hashes of the full blocks of `token_ids` (at most `max_blocks` of them)."""
    count = len(token_ids) // block_size
    if max_blocks is not None:
        count = min(count, max_blocks)
    hashes: list[int] = []
    parent: int | None = None
    for start in range(0, count * block_size, block_size):
        parent = hash_fn(parent, token_ids[start : start + block_size], extra_key)
        hashes.append(parent)
    return hashes


def _seed_int(seed: bytes) -> int:
    return xxhash.xxh3_64_intdigest(seed)


class BlockHasher:
    """Computes chained block hashes under one seed; instances are immutable."""

    __slots__ = ("_digest_key", "_seed", "_seed_bytes")

    def __init__(self, seed: bytes | None = None) -> None:
        if seed is not None and not isinstance(seed, bytes | bytearray):
            raise TypeError(f"hash_seed must be bytes or None, got {type(seed).__name__}")
        self._seed_bytes = bytes(seed) if seed is not None else _PROCESS_SEED
        self._seed = _seed_int(self._seed_bytes)
        self._digest_key = hashlib.blake2b(
            self._seed_bytes, digest_size=DIGEST_BYTES, person=b"kvmesh-prefix"
        ).digest()

    def hash_block(
        self, parent: int | None, tokens: Sequence[int], extra_key: bytes | None = None
    ) -> int:
        """Hash of one full block given its parent's hash (None for the first block)."""
        if extra_key:
            head = _NO_PARENT if parent is None else parent.to_bytes(16, "little")
            head += len(extra_key).to_bytes(4, "little") + extra_key
        else:  # the parent's 16 bytes and a zero key length in one call (parent < 2**128)
            head = _NO_PARENT_NO_KEY if parent is None else parent.to_bytes(20, "little")
        try:  # inline (not `_pack`): this runs once per block of every lookup and commit
            body = _packer(len(tokens)).pack(*tokens)
        except struct.error as exc:
            raise ValueError(_BAD_TOKENS) from exc
        return xxhash.xxh3_128_intdigest(head + body, seed=self._seed)

    def digest_block(
        self, parent: bytes | None, tokens: Sequence[int], extra_key: bytes | None = None
    ) -> bytes:
        """Prefix digest of one full block given its parent's digest (None for the first):
        equal only for equal token prefixes under equal extra keys (module docstring)."""
        key = extra_key or b""
        digest = hashlib.blake2b(digest_size=DIGEST_BYTES, key=self._digest_key)
        digest.update(parent or _NO_DIGEST)
        digest.update(len(key).to_bytes(4, "little") + key)
        digest.update(_pack(tokens))
        return digest.digest()

    def hash_blocks(
        self,
        token_ids: Sequence[int],
        block_size: int,
        extra_key: bytes | None = None,
        *,
        max_blocks: int | None = None,
    ) -> list[int]:
        """Hashes of the full blocks of `token_ids` (at most `max_blocks` of them)."""
        return chain_hashes(
            self.hash_block, token_ids, block_size, extra_key, max_blocks=max_blocks
        )
