"""Disk tier: one file per block under a folder, bounded by capacity and watermarks.

Files are `<block hash hex>.kvblock` in the `blockfile` format, written atomically. Without
`persist` the folder's block files are removed at start and at close (the tier holds only
what this process wrote); with it they are verified (header, layout, checksum) and kept,
oldest first in the LRU order, and the folder's hash seed is reused so equal prefixes hash
alike again (read, or made and synced, at start: a seed that can be neither is a ValueError
naming the folder). A write that fails (disk full) stores nothing and leaves no file.
A file that fails verification at any time is deleted and counted in `num_corrupt`.
A file that cannot be deleted (read-only remount, I/O error) is forgotten all the same and
counted in `num_unremoved`: files are named by their content's hash, so a file left behind can
only ever be read as that block, and a later write of the hash replaces it.
A tier collected without `close` (its engine dropped) still releases the folder's lock and,
without `persist`, deletes its block files: the folder is free for the next engine.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import weakref
from collections import OrderedDict
from pathlib import Path
from typing import Any

from kvmesh.memory.tiers import blockfile
from kvmesh.memory.tiers.blockfile import BlockMeta
from kvmesh.memory.tiers.watermarks import Watermarks

LOG = logging.getLogger(__name__)
SUFFIX = ".kvblock"
SEED_FILE = "hash-seed"
LOCK_FILE = "lock"


class DiskTier:
    """Block files of one cache layout (`layout`, `payload_bytes` per block) in `folder`."""

    name = "disk"

    def __init__(
        self,
        folder: str | Path,
        capacity: int,
        layout: dict[str, Any],
        payload_bytes: int,
        *,
        persist: bool = False,
        watermarks: Watermarks | None = None,
    ) -> None:
        if capacity <= 0:
            raise ValueError(f"disk tier capacity must be positive, got {capacity} blocks")
        self.folder = Path(folder)
        lock = _lock_folder(self.folder)  # held until `_release` runs (close or collection)
        self._release = weakref.finalize(
            self, _release_folder, self.folder, lock, persist, os.getpid()
        )
        self.capacity = capacity
        self.layout = layout
        self.payload_bytes = payload_bytes
        self.persist = persist
        self.watermarks = watermarks or Watermarks()
        self.num_corrupt = 0
        self.num_unremoved = 0
        self._unremoved: set[int] = set()  # hashes whose file outlived its removal
        self._index: OrderedDict[int, BlockMeta] = OrderedDict()
        self._seed: bytes | None = None
        if persist:
            self._scan()
            try:
                self._seed = self._load_seed()  # at start: an unusable folder fails it by name
            except ValueError:
                self._release()
                raise
        else:
            self._wipe()

    @property
    def num_used(self) -> int:
        return len(self._index)

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self._index

    def hashes(self) -> set[int]:
        return set(self._index)

    def meta(self, block_hash: int) -> BlockMeta | None:
        return self._index.get(block_hash)

    def path(self, block_hash: int) -> Path:
        return self.folder / f"{block_hash:032x}{SUFFIX}"

    def hash_seed(self) -> bytes:
        """The folder's hash seed (created once, private to the owner); ValueError naming the
        folder when it can be neither read nor written."""
        if self._seed is None:
            self._seed = self._load_seed()
        return self._seed

    def _load_seed(self) -> bytes:
        """The seed file's 16 bytes, or a new random seed written atomically and synced (so
        a crash never leaves a torn seed that would orphan every block file). A seed that
        cannot be read or written (an I/O error, a full disk, a directory in its place) is a
        ValueError naming the folder, which the engine reports as `disk_kv_dir`."""
        path = self.folder / SEED_FILE
        try:
            try:
                seed = path.read_bytes()
                if len(seed) == 16:
                    return seed
            except FileNotFoundError:
                pass
            seed = os.urandom(16)
            blockfile.write_atomic(path, seed, mode=0o600, sync=True)
        except OSError as error:
            raise ValueError(
                f"disk KV folder {self.folder} cannot be used: its hash seed {path.name}"
                f" cannot be read or written: {error}"
            ) from None
        return seed

    def close(self) -> None:
        """Release the folder for another process; the block files stay only when
        persistent (without persistence no later process can hit them)."""
        if not self.persist:
            self._wipe()
            self._index.clear()
        self._release()  # the lock (once: a finalizer never runs twice)

    # -- blocks ------------------------------------------------------------------------------
    def put(self, meta: BlockMeta, payload: bytes | memoryview) -> bool:
        """Write one block (replacing nothing: a hash has one copy); False (nothing stored, no
        file left) when the write fails: disk full, folder gone, I/O error."""
        assert meta.block_hash not in self._index, "a hash has one disk copy"
        data = blockfile.encode(meta, self.layout, payload)
        try:
            blockfile.write_atomic(self.path(meta.block_hash), data)
        except OSError:
            return False
        self._index[meta.block_hash] = meta
        self._unremoved.discard(meta.block_hash)
        return True

    def read(self, block_hash: int) -> bytes | None:
        """The raw file (thread-safe: no bookkeeping); None when it is gone."""
        try:
            return self.path(block_hash).read_bytes()
        except OSError:
            return None

    def verify(self, block_hash: int, data: bytes | None) -> memoryview | None:
        """The payload of `data` when it is this block's intact file; else None, and the
        block is dropped (counted as corrupt when a file was there)."""
        decoded = None
        if data is not None:
            decoded = blockfile.decode(data, self.layout, block_hash, self.payload_bytes)
        meta = self._index.get(block_hash)
        if decoded is None or meta is None or decoded[0] != meta:
            self.num_corrupt += data is not None
            self.remove(block_hash)
            return None
        return decoded[1]

    def remove(self, block_hash: int) -> None:
        """Forget the block and delete its file; never raises (see the module's note)."""
        self._index.pop(block_hash, None)
        try:
            self.path(block_hash).unlink(missing_ok=True)
        except OSError as error:
            if not self.num_unremoved:
                LOG.warning("disk KV tier cannot delete block files (%s); counting them", error)
            self.num_unremoved += 1
            self._unremoved.add(block_hash)

    def touch(self, block_hash: int) -> None:
        self._index.move_to_end(block_hash)

    def oldest(self) -> int | None:
        return next(iter(self._index), None)

    # -- start -------------------------------------------------------------------------------
    def _block_files(self) -> list[Path]:
        return [p for p in self.folder.iterdir() if p.name.endswith(SUFFIX)]

    def _torn_writes(self) -> list[Path]:
        """Temporary files of writes that never finished (block files and the hash seed; the
        seed's old temporary name included): the folder is locked, so none is under way."""
        patterns = (f".*{SUFFIX}.*.tmp", f".{SEED_FILE}.*.tmp", f"{SEED_FILE}.tmp")
        return [path for pattern in patterns for path in self.folder.glob(pattern)]

    def _wipe(self) -> None:
        """Delete every block file and torn write; never raises (files left are counted, a
        folder that cannot be listed, gone or failing, has nothing this can delete)."""
        try:
            paths = [*self._block_files(), *self._torn_writes()]
        except OSError:
            return
        for path in paths:
            self._delete(path)

    def _delete(self, path: Path) -> None:
        """Delete a file of the folder, never raising: a block file this tier names through
        `remove` (counted when it cannot be deleted), a torn write or a stranger's name
        directly (nothing of its own to count)."""
        try:
            block_hash: int | None = int(path.name.removesuffix(SUFFIX), 16)
        except ValueError:
            block_hash = None
        if block_hash is not None and self.path(block_hash) == path:
            self.remove(block_hash)
            return
        with contextlib.suppress(OSError):
            path.unlink(missing_ok=True)

    def _scan(self) -> None:
        """Keep the files that verify (oldest first); delete the rest and any torn write. An
        entry that cannot be read or deleted (a dangling link, a directory in a file's place)
        is dropped and counted as `remove` counts it: a restart never fails on one."""
        for path in self._torn_writes():
            self._delete(path)
        for path in sorted(self._block_files(), key=_age):
            meta = self._verify_file(path)
            if meta is not None:
                self._index[meta.block_hash] = meta
                continue
            self.num_corrupt += 1
            self._delete(path)
        while len(self._index) > self.capacity:
            oldest = self.oldest()
            assert oldest is not None
            self.remove(oldest)

    def _verify_file(self, path: Path) -> BlockMeta | None:
        try:
            block_hash = int(path.name.removesuffix(SUFFIX), 16)
            data = path.read_bytes()
        except (OSError, ValueError):
            return None
        decoded = blockfile.decode(data, self.layout, block_hash, self.payload_bytes)
        return None if decoded is None else decoded[0]

    def check_integrity(self) -> None:
        """AssertionError unless the index and the folder's block files agree."""
        on_disk = {int(p.name.removesuffix(SUFFIX), 16) for p in self._block_files()}
        indexed = set(self._index)
        assert indexed <= on_disk, "an indexed disk block has no file"
        assert on_disk - indexed <= self._unremoved, "a block file outside the index"
        assert len(self._index) <= self.capacity, "disk tier over capacity"


def _release_folder(folder: Path, lock: int, persist: bool, owner: int) -> None:
    """What a tier holds until it is closed or collected: without `persist` its block files
    (best effort; `close` has deleted them already), then the folder's lock. Nothing in a
    forked child (`owner` is the creating process): the files are its parent's."""
    if os.getpid() != owner:
        return
    if not persist:
        with contextlib.suppress(OSError):
            for path in folder.glob(f"*{SUFFIX}"):
                with contextlib.suppress(OSError):
                    path.unlink()
    os.close(lock)


def _lock_folder(folder: Path) -> int:
    """The folder, made if missing, and an exclusive lock on it until its tier is closed or
    collected: two engines sharing one disk tier would delete each other's files. ValueError
    when another engine holds it, or when it cannot be made or locked (a file in its place, a
    read-only mount, no permission)."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd = os.open(folder / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o600)
    except OSError as error:
        raise ValueError(f"disk KV folder {folder} cannot be used: {error}") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise ValueError(
            f"disk KV folder {folder} is in use by another process; give each engine its own"
        ) from None
    return fd


def _age(path: Path) -> float:
    """A block file's modification time for the start-up order (an entry that cannot be
    stat'ed, a dangling link, sorts last: its verification fails)."""
    try:
        return path.stat().st_mtime
    except OSError:
        return float("inf")
