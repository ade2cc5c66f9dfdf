"""On-disk format of one KV block: a checked header, then the block's bytes.

    magic "KVMBLK02" (8) | header length u32 | header xxh3-64 u64 | header (JSON) | payload

The header names the layout (the cache spec), the storage dtype, the block's chain hash, its
parent hash, tokens, extra key and prefix digest (so a hit is as strict as on the device: the
digest stands for the whole prefix, `kvmesh.memory.hashing`), the payload length and the
payload's xxh3-128. `decode` returns None for anything that is not a complete,
matching, uncorrupted file: a bad file is a miss, never KV. Writes are atomic (tmp + rename).
"""

from __future__ import annotations

import contextlib
import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import xxhash

from kvmesh.memory.hashing import DIGEST_BYTES

MAGIC = b"KVMBLK02"  # 02: the header carries the prefix digest
_PREFIX = struct.Struct("<8sIQ")  # magic, header length, header checksum
MAX_HEADER_BYTES = 1 << 20


@dataclass(frozen=True, slots=True)
class BlockMeta:
    """What identifies a cached block's contents: a lower copy serves a lookup only when all
    of it is equal, the prefix `digest` (`BlockHasher.digest_block`) included."""

    block_hash: int
    parent_hash: int | None
    tokens: tuple[int, ...]
    extra_key: bytes | None
    digest: bytes


def encode(meta: BlockMeta, layout: dict[str, Any], payload: bytes | memoryview) -> bytes:
    """The whole file for one block (`layout`: plain JSON values naming shape and dtypes)."""
    header = {
        "layout": layout,
        "block_hash": f"{meta.block_hash:032x}",
        "parent_hash": None if meta.parent_hash is None else f"{meta.parent_hash:032x}",
        "tokens": list(meta.tokens),
        "extra_key": None if meta.extra_key is None else meta.extra_key.hex(),
        "prefix_digest": meta.digest.hex(),
        "payload_bytes": len(payload),
        "payload_xxh3_128": xxhash.xxh3_128_hexdigest(payload),
    }
    head = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    prefix = _PREFIX.pack(MAGIC, len(head), xxhash.xxh3_64_intdigest(head))
    return b"".join((prefix, head, bytes(payload)))


def decode_header(data: bytes) -> tuple[dict[str, Any], int] | None:
    """(header, payload offset) of a file's leading bytes, or None when malformed."""
    if len(data) < _PREFIX.size:
        return None
    magic, length, checksum = _PREFIX.unpack_from(data)
    end = _PREFIX.size + length
    if magic != MAGIC or length > MAX_HEADER_BYTES or len(data) < end:
        return None
    head = data[_PREFIX.size : end]
    if xxhash.xxh3_64_intdigest(head) != checksum:
        return None
    try:
        header = json.loads(head)
    except ValueError:
        return None
    return (header, end) if isinstance(header, dict) else None


def meta_of(header: dict[str, Any]) -> BlockMeta | None:
    """The BlockMeta a header names, or None when a field is missing or mistyped."""
    try:
        parent = header["parent_hash"]
        key = header["extra_key"]
        tokens = header["tokens"]
        digest = bytes.fromhex(header["prefix_digest"])
        if not all(isinstance(t, int) for t in tokens) or len(digest) != DIGEST_BYTES:
            return None
        return BlockMeta(
            int(header["block_hash"], 16),
            None if parent is None else int(parent, 16),
            tuple(tokens),
            None if key is None else bytes.fromhex(key),
            digest,
        )
    except (KeyError, TypeError, ValueError):
        return None


def decode(
    data: bytes, layout: dict[str, Any], block_hash: int, payload_bytes: int
) -> tuple[BlockMeta, memoryview] | None:
    """(meta, payload) when `data` is a complete, uncorrupted file of `block_hash` in
    `layout` with `payload_bytes` of KV; None otherwise."""
    parsed = decode_header(data)
    if parsed is None:
        return None
    header, offset = parsed
    meta = meta_of(header)
    if meta is None or meta.block_hash != block_hash or header.get("layout") != layout:
        return None
    payload = memoryview(data)[offset:]
    if header.get("payload_bytes") != payload_bytes or len(payload) != payload_bytes:
        return None
    if xxhash.xxh3_128_hexdigest(payload) != header.get("payload_xxh3_128"):
        return None
    return meta, payload


def write_atomic(path: Path, data: bytes, *, mode: int = 0o666, sync: bool = False) -> None:
    """Write `data` to `path` so a reader sees the old file, the new one, or none: never half.
    A write that fails (OSError: disk full, folder gone) leaves no temporary file behind.
    `mode` is the new file's (less the umask); `sync` makes the file durable before it is
    renamed, and the rename after it (block files go without: a file torn by a crash fails
    its checksum)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
        with os.fdopen(fd, "wb") as out:
            out.write(data)
            if sync:
                out.flush()
                os.fsync(out.fileno())
        os.replace(tmp, path)
    except OSError:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        raise
    if sync:
        _sync_folder(path.parent)


def _sync_folder(folder: Path) -> None:
    """Make a rename in `folder` durable (best effort: some file systems refuse a folder's
    fsync, and the file itself is already synced)."""
    with contextlib.suppress(OSError):
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
