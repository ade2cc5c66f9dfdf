"""A TieredStore sized from byte budgets, the block hash seed it implies, and the identity of
the checkpoint whose KV it holds."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import xxhash
from kvmesh_kernels.cache import PagedKVCache

from kvmesh.memory.tiers.device import DeviceBlocks
from kvmesh.memory.tiers.disk import DiskTier
from kvmesh.memory.tiers.host import HostTier
from kvmesh.memory.tiers.store import TieredStore

GIB = 1 << 30


@dataclass(frozen=True)
class TierSettings:
    """Budgets of the lower tiers; `disk_dir` None = no disk tier."""

    host_bytes: int
    disk_dir: str | None = None
    disk_bytes: int = 4 * GIB
    persist: bool = False


def build_store(cache: PagedKVCache, settings: TierSettings, model_id: str) -> TieredStore:
    """Host tier (pinned on CUDA) and optional disk tier for `cache`'s blocks.

    ValueError when a budget holds no block."""
    device = DeviceBlocks(cache, model_id)
    host_blocks = settings.host_bytes // device.block_bytes
    if host_blocks < 1:
        raise ValueError(
            f"host tier budget {settings.host_bytes} bytes holds no block"
            f" of {device.block_bytes} bytes"
        )
    host = HostTier(host_blocks, device.data_bytes, device.scale_bytes, pin=device.pin)
    disk = None
    if settings.disk_dir is not None:
        disk_blocks = settings.disk_bytes // device.block_bytes
        if disk_blocks < 1:
            raise ValueError(f"disk tier budget {settings.disk_bytes} bytes holds no block")
        disk = DiskTier(
            settings.disk_dir,
            disk_blocks,
            device.layout,
            device.block_bytes,
            persist=settings.persist,
        )
    return TieredStore(device, host, disk)


def persistent_seed(store: TieredStore, model_id: str) -> bytes | None:
    """The hash seed that makes a persistent disk tier's files hit again after a restart
    (the folder's seed, keyed by the model); None (a per-process seed) otherwise."""
    disk = store.disk
    if disk is None or not disk.persist:
        return None
    return xxhash.xxh3_128_digest(disk.hash_seed() + model_id.encode())


def checkpoint_identity(path: Path) -> str:
    """`path` and a digest of its files' names, sizes and modification times (a folder's
    top-level files). A checkpoint rebuilt in place (retrained, converted again) gets a new
    identity, so a persistent disk tier keyed by it never serves the old weights' KV."""
    files = sorted(p for p in path.iterdir() if p.is_file()) if path.is_dir() else [path]
    digest = xxhash.xxh3_64()
    for file in files:
        stat = file.stat()
        digest.update(f"{file.name}\0{stat.st_size}\0{stat.st_mtime_ns}\0".encode())
    return f"{path}#{digest.hexdigest()}"
