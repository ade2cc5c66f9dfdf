"""Chained, seeded block hashes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from kvmesh.memory import BlockHasher, BlockManager

ROOT = Path(__file__).resolve().parents[2]
TOKENS = list(range(40))


def test_same_seed_same_hashes_and_chain_depends_on_parent() -> None:
    a, b = BlockHasher(b"seed"), BlockHasher(b"seed")
    assert a.hash_blocks(TOKENS, 16) == b.hash_blocks(TOKENS, 16)
    hashes = a.hash_blocks(TOKENS, 16)
    assert len(hashes) == 2
    assert hashes[1] == a.hash_block(hashes[0], TOKENS[16:32])
    assert hashes[1] != a.hash_block(None, TOKENS[16:32])


def test_different_seeds_give_different_hashes() -> None:
    assert BlockHasher(b"one").hash_blocks(TOKENS, 16) != BlockHasher(b"two").hash_blocks(
        TOKENS, 16
    )


def test_unseeded_hash_is_stable_within_a_process_and_differs_across_processes() -> None:
    here = BlockHasher().hash_block(None, [1, 2, 3, 4])
    assert here == BlockHasher().hash_block(None, [1, 2, 3, 4])
    code = (
        "from kvmesh.memory.hashing import BlockHasher;"
        "print(BlockHasher().hash_block(None, [1, 2, 3, 4]))"
    )
    other = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT
    ).stdout
    assert int(other) != here


def test_extra_key_and_token_width_are_part_of_the_key() -> None:
    hasher = BlockHasher(b"s")
    assert hasher.hash_block(None, [1, 2], b"x") != hasher.hash_block(None, [1, 2])
    assert hasher.hash_block(None, [1, 2], b"x") != hasher.hash_block(None, [1, 2], b"y")
    assert hasher.hash_block(None, [1, 2]) != hasher.hash_block(None, [1 + (2 << 32)])
    with pytest.raises(ValueError, match="token_ids"):
        hasher.hash_block(None, [1 << 70])
    with pytest.raises(TypeError, match="hash_seed"):
        BlockHasher("text")  # type: ignore[arg-type]


def test_manager_block_hashes_match_the_hasher() -> None:
    manager = BlockManager(8, 16, hash_seed=b"seed")
    assert manager.block_hashes(TOKENS) == BlockHasher(b"seed").hash_blocks(TOKENS, 16)
    assert manager.block_hashes(TOKENS[:15]) == []


def test_prefix_digest_stands_for_the_whole_prefix() -> None:
    """The digest of a block depends on every token before it (unlike a forced collision of
    the block hash), on the extra key and on the seed; bad tokens are refused alike."""
    hasher = BlockHasher(b"s")
    first = hasher.digest_block(None, [1, 2])
    assert len(first) == 32 and first == BlockHasher(b"s").digest_block(None, [1, 2])
    assert first != BlockHasher(b"t").digest_block(None, [1, 2])
    assert first != hasher.digest_block(None, [1, 2], b"x")
    other = hasher.digest_block(None, [2, 1])
    assert hasher.digest_block(first, [3, 4]) != hasher.digest_block(other, [3, 4])
    with pytest.raises(ValueError, match="token_ids"):
        hasher.digest_block(None, [1 << 70])
