"""A real CPU KV cache under a BlockManager with host and disk tiers, and a shadow model
runner: the KV written at a position is a number computed from the context up to it, so a
sequence reading back anything but its own context's KV (a wrong hit, a bad reload, a corrupt
file fed to attention) is caught."""

from __future__ import annotations

import resource
import signal
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import torch
from kvmesh_kernels.cache import KVCacheSpec, allocate_kv_cache

from kvmesh.memory import BlockManager
from kvmesh.memory.hashing import HashFn
from kvmesh.memory.tiers.device import DeviceBlocks
from kvmesh.memory.tiers.disk import DiskTier
from kvmesh.memory.tiers.host import HostTier
from kvmesh.memory.tiers.store import TieredStore

BLOCK_SIZE = 4


def context_value(tokens: Sequence[int], pos: int) -> float:
    """The KV 'computed' at `pos`: a function of every token up to it (exact in float32)."""
    value = 0
    for token in tokens[: pos + 1]:
        value = (value * 31 + token + 1) % (1 << 20)
    return float(value)


@contextmanager
def file_size_limit(limit: int) -> Iterator[None]:
    """Writes past `limit` bytes of a file fail with EFBIG: a real OS limit, standing in for a
    full disk (the usual SIGXFSZ ignored meanwhile; main thread only)."""
    old = resource.getrlimit(resource.RLIMIT_FSIZE)
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, old[1]))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, old)
        signal.signal(signal.SIGXFSZ, handler)


class TieredRig:
    """Device pool of `device_blocks`, host tier of `host_blocks`, optional disk tier (and a
    chosen block hash, `hash_fn`, to force collisions)."""

    def __init__(
        self,
        device_blocks: int,
        host_blocks: int,
        disk_dir: Path | None = None,
        disk_blocks: int = 8,
        *,
        persist: bool = False,
        hash_fn: HashFn | None = None,
    ) -> None:
        spec = KVCacheSpec(device_blocks, 1, BLOCK_SIZE, 1, 32)
        self.cache = allocate_kv_cache(spec)
        self.device = DeviceBlocks(self.cache, "rig")
        host = HostTier(host_blocks, self.device.data_bytes)
        disk = None
        if disk_dir is not None:
            disk = DiskTier(
                disk_dir, disk_blocks, self.device.layout, self.device.block_bytes, persist=persist
            )
        self.store = TieredStore(self.device, host, disk, reload_deadline_s=2.0)
        seed = disk.hash_seed() if disk is not None else b"rig"
        self.manager = BlockManager(
            device_blocks, BLOCK_SIZE, hash_seed=seed, hash_fn=hash_fn, tiers=self.store
        )

    def run_prompt(self, seq_id: str, tokens: list[int]) -> int | None:
        """Admit, 'compute' and verify one prompt; its cached token count, or None when the
        pool cannot hold it now (nothing changed)."""
        manager = self.manager
        cached = manager.lookup_prefix(seq_id, tokens)
        if manager.allocate(seq_id, len(tokens)) is None:
            manager.free(seq_id)
            return None
        self.store.prepare_step()
        self.write(seq_id, tokens, cached)
        self.verify(seq_id, tokens)
        manager.commit(seq_id, tokens, len(tokens))
        return cached

    def write(self, seq_id: str, tokens: list[int], start: int) -> None:
        table = self.manager.block_table(seq_id)
        for pos in range(start, len(tokens)):
            block, offset = table[pos // BLOCK_SIZE], pos % BLOCK_SIZE
            self.cache.data[block, :, :, offset] = context_value(tokens, pos)

    def verify(self, seq_id: str, tokens: list[int]) -> None:
        table = self.manager.block_table(seq_id)
        for pos in range(len(tokens)):
            block, offset = table[pos // BLOCK_SIZE], pos % BLOCK_SIZE
            got = self.cache.data[block, :, :, offset]
            assert torch.all(got == context_value(tokens, pos)), f"{seq_id}: wrong KV at {pos}"

    def close(self) -> None:
        self.store.close()
