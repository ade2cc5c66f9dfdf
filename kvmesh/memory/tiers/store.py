"""TieredStore: the host and disk tiers below the device cache, and every copy between them.

Rules (one authoritative copy of each block hash):
- A published prefix block lives in exactly one tier: device, host or disk (the hash sets are
  disjoint). Moving down frees the upper copy (the device block is evicted, the host slot
  freed once the file is written); moving up frees the lower copy as soon as the upper one is
  claimed (a reload's host slot stays in flight until its copy to the device completes).
- The device publishing a hash frees any lower copy of it (`discard`).
- Evicted device blocks spill to host (`spill`, copied by `flush_spills` before the block
  manager hands the block to anyone); a full host demotes its least recently used block to
  disk, a full disk drops its oldest. Above a tier's high watermark it sheds to its low one.
- A reload claimed by a lookup (`take`) is copied into its device block by `prepare_step`,
  which the engine runs before the step that reads it. A device block evicted before its
  reload ran holds stale bytes: the reload is cancelled and its host slot, which holds the
  block's KV, is the hash's host copy again (never a spill of the stale bytes). A block freed
  before its reload ran (a swapped-in sequence refused its first chunk) drops the reload and
  its slot (`drop_reloads`), so a block is the target of at most one queued copy. Disk reads
  run on a background thread: `prefetch` starts them when a request arrives, so admission
  finds the block on the host; a lookup waits for a started read at most
  `reload_deadline_s`, then counts a miss.
- A disk file that fails verification is a miss and is deleted: it is never fed to attention.
- Swapped-out sequences hold host slots of their own until swapped in or dropped.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout

from kvmesh.memory.tiers.blockfile import BlockMeta
from kvmesh.memory.tiers.costs import Rates
from kvmesh.memory.tiers.device import DeviceBlocks, DeviceCopy
from kvmesh.memory.tiers.disk import DiskTier
from kvmesh.memory.tiers.host import HostEntry, HostTier
from kvmesh.memory.tiers.stats import SwapCounters, TierCounters, TierSnapshot, snapshot


class TieredStore:
    """Host tier (required) and optional disk tier under one device cache."""

    def __init__(
        self,
        device: DeviceBlocks,
        host: HostTier,
        disk: DiskTier | None = None,
        *,
        reload_deadline_s: float = 5.0,
    ) -> None:
        self.device, self.host, self.disk = device, host, disk
        self.reload_deadline_s = reload_deadline_s
        self.host_stats, self.disk_stats = TierCounters(), TierCounters()
        self.swap_stats = SwapCounters()
        self.rates = Rates()
        if disk is not None:
            self.disk_stats.corrupt = disk.num_corrupt
        self._spills: list[tuple[int, int, BlockMeta]] = []  # (device block, host slot, meta)
        self._reloads: dict[int, int] = {}  # device block -> host slot: one copy per block
        self._reload_queued: float | None = None  # when the first of `_reloads` was queued
        # CUDA copies issued and not yet known complete: (copy, host slots, queued at)
        self._in_flight: list[tuple[DeviceCopy, list[int], float]] = []
        self._reads: dict[int, Future[bytes | None]] = {}
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="kvmesh-tier-read")
        self.closed = False
        self._probe_bandwidth()

    def _probe_bandwidth(self) -> None:
        """A first copy-bandwidth sample (device block 0 into a free host slot, both unused
        yet), so the swap/recompute estimate works before the first real copy."""
        slots = self.host.take_free(1)
        assert slots is not None
        self._to_host([0], slots)
        self.host.release(slots)

    def close(self) -> None:
        """Stop the reader; a persistent disk tier first receives the host's cached blocks
        (so a restart finds chains whole: their heads stay on the host longest)."""
        self.closed = True
        self._reader.shutdown(wait=True, cancel_futures=True)
        self._reads.clear()
        if self.disk is not None and self.disk.persist:
            self.flush_spills()
            self._release_done()
            self._shed_host(self.host.num_cached)
        if self.disk is not None:
            self.disk.close()

    # -- spill (device -> host -> disk) ------------------------------------------------------
    def spill(self, block_id: int, meta: BlockMeta) -> None:
        """A device block holding `meta` is being evicted: queue its copy down (or, where its
        reload has not run yet, cancel that instead: `_cancel_reload`)."""
        assert meta.block_hash not in self.host and not self._on_disk(meta.block_hash), (
            "an evicted device block's hash already has a lower copy"
        )
        if self._cancel_reload(block_id, meta):
            return
        if not self.host.num_free and not self.host.num_cached:
            self.flush_spills()  # queued spills become demotable host blocks
        slot = self._free_host_slot()
        if slot is None:
            self.host_stats.dropped += 1
            return
        self._spills.append((block_id, slot, meta))

    def _cancel_reload(self, block_id: int, meta: BlockMeta) -> bool:
        """Drop the queued reload into `block_id` (evicted before it landed, so the block holds
        stale bytes) and give its host slot back to the host's cache as `meta`'s copy; whether
        one was queued."""
        slot = self._reloads.pop(block_id, None)
        if slot is None:
            return False
        self.host.restore(meta, slot)
        return True

    def drop_reloads(self, block_ids: Sequence[int]) -> None:
        """Blocks going back to the free list (their sequence freed before the step ran): drop
        the copies still queued into them and free those host slots. Their KV is given up (a
        swapped-in sequence refused its first chunk recomputes); a copy left queued would land
        in whatever the block holds next, possibly after another copy into it."""
        dropped = [self._reloads.pop(b) for b in block_ids if b in self._reloads]
        self.host.release(dropped)

    def flush_spills(self) -> None:
        """Copy the queued spills out of their device blocks (before anyone reuses them)."""
        if not self._spills:
            return
        spills, self._spills = self._spills, []
        self._to_host([s[0] for s in spills], [s[1] for s in spills])
        for _, slot, meta in spills:
            self.host.add(meta, slot)
        self.host_stats.spills += len(spills)
        self.host_stats.bytes_in += len(spills) * self.device.block_bytes
        self._release_done(wait=False)  # completed copies' slots are not in use
        self._shed_host(self.host.watermarks.excess(self.host.num_used, self.host.capacity))

    def _to_host(self, block_ids: Sequence[int], slots: Sequence[int]) -> None:
        started = time.perf_counter()
        self.device.to_host(block_ids, self.host, slots)
        self.rates.observe_copy(len(slots) * self.device.block_bytes, time.perf_counter() - started)

    def _free_host_slot(self) -> int | None:
        if not self.host.num_free:
            self._release_done(wait=False)  # slots of completed copies are free already
        if not self.host.num_free and self._reloads:
            self._run_reloads()  # their device blocks are allocated: landing early is safe
            self._release_done()
        if not self.host.num_free:
            self._shed_host(1)
        slots = self.host.take_free(1)
        return None if slots is None else slots[0]

    def _shed_host(self, count: int) -> None:
        """Demote up to `count` least recently used host blocks to disk (or drop them)."""
        for _ in range(count):
            entry = self.host.oldest()
            if entry is None:
                return
            if not self._demote(entry):
                self.host_stats.dropped += 1
            self.host.pop(entry.meta.block_hash, inflight=False)

    def _demote(self, entry: HostEntry) -> bool:
        """Write a host block to disk; whether it is there now (False: no disk tier, or the
        write failed, e.g. disk full: the block is dropped, the caller goes on)."""
        disk = self.disk
        if disk is None:
            return False
        payload = self.device.payload(self.host, entry.slot)
        self._make_disk_room()
        if not disk.put(entry.meta, payload):
            return False
        self.disk_stats.spills += 1
        self.disk_stats.bytes_in += len(payload)
        return True

    def _make_disk_room(self) -> None:
        disk = self.disk
        assert disk is not None
        excess = disk.watermarks.excess(disk.num_used + 1, disk.capacity)
        excess = max(excess, disk.num_used + 1 - disk.capacity)
        for _ in range(excess):
            oldest = disk.oldest()
            if oldest is None:
                return
            self._forget_read(oldest)
            disk.remove(oldest)
            self.disk_stats.dropped += 1

    # -- lookup and reload (disk -> host -> device) ------------------------------------------
    def contains(self, block_hash: int) -> bool:
        return block_hash in self.host or self._on_disk(block_hash)

    def _on_disk(self, block_hash: int) -> bool:
        return self.disk is not None and block_hash in self.disk

    def take(self, meta: BlockMeta, block_id: int) -> bool:
        """Claim the lower copy of exactly `meta` (prefix digest included: one prefix's KV is
        never served for another whose hashes collide) for device block `block_id` (copied
        there by the next `prepare_step`); False (nothing changed) when no intact copy is found."""
        self._collect_reads()
        entry = self.host.get(meta.block_hash)
        if entry is not None:
            if entry.meta != meta:
                return False
            self.host.pop(meta.block_hash, inflight=True)
            self.host_stats.hits += 1
            self._queue_reload(entry.slot, block_id)
            return True
        return self._take_from_disk(meta, block_id)

    def _take_from_disk(self, meta: BlockMeta, block_id: int) -> bool:
        disk = self.disk
        if disk is None or disk.meta(meta.block_hash) != meta:
            return False
        started = time.perf_counter()
        payload = self._read_disk(meta.block_hash)
        if payload is None:
            self.disk_stats.corrupt = disk.num_corrupt
            return False
        # Off the disk before making a host slot: demoting a host block to make that slot must
        # not evict this very block (it would count as dropped and reloaded at once).
        disk.remove(meta.block_hash)
        slot = self._free_host_slot()
        if slot is None:  # no host slot (all in flight or swapped): the block stays on disk
            self._restore_to_disk(meta, payload)
            return False
        self.device.load_payload(self.host, slot, payload)
        self.host.hold([slot])
        self.disk_stats.reload_seconds += time.perf_counter() - started  # read, check, to host
        self.disk_stats.reload_batches += 1
        self.disk_stats.hits += 1
        self.disk_stats.reloads += 1
        self.disk_stats.bytes_out += len(payload)
        self._queue_reload(slot, block_id)
        return True

    def _restore_to_disk(self, meta: BlockMeta, payload: memoryview) -> None:
        """Put back a block taken off the disk for a reload that found no host slot (nothing
        was demoted then, so its room is still there); a write that fails drops it."""
        assert self.disk is not None
        self._make_disk_room()
        if not self.disk.put(meta, payload):
            self.disk_stats.dropped += 1

    def _read_disk(self, block_hash: int) -> memoryview | None:
        """The verified payload of a disk block: from its started read (bounded wait) or now."""
        assert self.disk is not None
        future = self._reads.pop(block_hash, None)
        if future is None:
            data = self.disk.read(block_hash)
        else:
            try:
                data = future.result(timeout=self.reload_deadline_s)
            except FutureTimeout:
                return None  # a miss; the read finishes unused
        return self.disk.verify(block_hash, data)

    def _queue_reload(self, slot: int, block_id: int) -> None:
        # Two queued copies into one block would land in slot order, not queue order.
        assert block_id not in self._reloads, "block already reloading"
        if not self._reloads:
            self._reload_queued = time.perf_counter()
        self._reloads[block_id] = slot

    def discard(self, block_hash: int) -> None:
        """The device published `block_hash`: free any lower copy."""
        if self.host.pop(block_hash, inflight=False) is None and self._on_disk(block_hash):
            assert self.disk is not None
            self._forget_read(block_hash)
            self.disk.remove(block_hash)

    # -- prefetch ----------------------------------------------------------------------------
    def prefetch(self, block_hashes: Iterable[int]) -> int:
        """Start background reads of the disk blocks among `block_hashes`; how many started.
        A finished read moves its block to the host tier at the next lookup or step."""
        if self.disk is None or self.closed:
            return 0
        started = 0
        for block_hash in block_hashes:
            if block_hash not in self.disk or block_hash in self._reads:
                continue
            if len(self._reads) >= self.host.capacity // 2:
                break
            self._reads[block_hash] = self._reader.submit(self.disk.read, block_hash)
            started += 1
        return started

    def _collect_reads(self) -> None:
        """Promote finished background reads into host slots (verified; bad ones dropped)."""
        disk = self.disk
        for block_hash in [h for h, f in self._reads.items() if f.done()]:
            data = self._reads.pop(block_hash).result()
            meta = disk.meta(block_hash) if disk is not None else None
            if disk is None or meta is None or not self.host.num_free:
                continue
            payload = disk.verify(block_hash, data)
            self.disk_stats.corrupt = disk.num_corrupt
            if payload is None:
                continue
            slot = self._free_host_slot()
            assert slot is not None
            self.device.load_payload(self.host, slot, payload)
            disk.remove(block_hash)
            self.host.add(meta, slot)
            self.disk_stats.reloads += 1
            self.disk_stats.bytes_out += len(payload)

    def _forget_read(self, block_hash: int) -> None:
        future = self._reads.pop(block_hash, None)
        if future is not None:
            future.cancel()

    # -- the step ----------------------------------------------------------------------------
    def prepare_step(self) -> None:
        """Run the queued reloads and swap-ins into their device blocks (before the step's
        first write or read of them); release host slots whose copies completed."""
        self.flush_spills()
        self._release_done()
        self._collect_reads()
        self._run_reloads()

    def _run_reloads(self) -> None:
        if not self._reloads:
            return
        reloads, self._reloads = self._reloads, {}
        blocks, slots = list(reloads), list(reloads.values())
        assert self._reload_queued is not None
        copy_started = time.perf_counter()
        copy = self.device.from_host(self.host, slots, blocks)
        if copy is None:  # CPU: the copy is done, and timed here
            self._finish_reload(slots, self._reload_queued, time.perf_counter() - copy_started)
        else:  # CUDA: asynchronous, timed by its own events once complete
            self._in_flight.append((copy, slots, self._reload_queued))

    def _release_done(self, *, wait: bool = True) -> None:
        """Release the host slots of the reload copies in flight: all of them, waiting for
        those still running, or without `wait` only those already complete (never blocks)."""
        running = []
        for copy, slots, queued in self._in_flight:
            if not wait and not copy.query():
                running.append((copy, slots, queued))
                continue
            copy.synchronize()
            self._finish_reload(slots, queued, copy.seconds())
        self._in_flight = running

    def _finish_reload(self, slots: list[int], queued: float, copy_seconds: float) -> None:
        """A reload copy of `slots` completed: the copy's own duration feeds the bandwidth
        estimate (swap or recompute), the time since it was queued (at the lookup or swap-in)
        the reload latency; its host slots are free again."""
        size = len(slots) * self.device.block_bytes
        self.rates.observe_copy(size, copy_seconds)
        self.host_stats.copy_seconds += copy_seconds
        self.host_stats.copy_bytes += size
        self.host_stats.reload_seconds += time.perf_counter() - queued
        self.host_stats.reload_batches += 1
        self.host_stats.reloads += len(slots)
        self.host_stats.bytes_out += size
        self.host.release(slots)

    # -- swap --------------------------------------------------------------------------------
    def swap_out(self, seq_id: str, block_ids: Sequence[int]) -> bool:
        """Copy a preempted sequence's blocks to host slots of its own; False (nothing
        changed) when the host cannot hold them even after demoting cached blocks."""
        count = len(block_ids)
        self._release_done(wait=False)  # completed reload copies hold slots nothing reads
        if count > self.host.num_free + self.host.num_cached:
            return False
        if any(block in self._reloads for block in block_ids):
            self._run_reloads()  # copies still queued into these blocks land first
            self._release_done()
        self._shed_host(max(0, count - self.host.num_free))
        slots = self.host.take_free(count)
        if slots is None:
            return False
        self._to_host(block_ids, slots)
        self.host.park(seq_id, slots)
        self.swap_stats.swapped_out += 1
        self.swap_stats.swap_bytes += count * self.device.block_bytes
        self.host_stats.spills += count  # written into the host, as a swap-in's are reloads
        self.host_stats.bytes_in += count * self.device.block_bytes
        return True

    def swap_in(self, seq_id: str, block_ids: Sequence[int]) -> None:
        """Queue the copy of a swapped-out sequence into its new device blocks."""
        slots = self.host.unpark(seq_id)
        assert slots is not None and len(slots) == len(block_ids), f"{seq_id!r} not swapped"
        self.host.hold(slots)
        for slot, block in zip(slots, block_ids, strict=True):
            self._queue_reload(slot, block)
        self.swap_stats.swapped_in += 1
        self.swap_stats.swap_bytes += len(slots) * self.device.block_bytes

    def drop_swapped(self, seq_id: str) -> None:
        slots = self.host.unpark(seq_id)
        if slots is not None:
            self.host.release(slots)

    # -- observability -----------------------------------------------------------------------
    def metrics(self) -> list[TierSnapshot]:
        size = self.device.block_bytes
        tiers = [snapshot("host", self.host.capacity, self.host.num_used, size, self.host_stats)]
        if self.disk is not None:
            used = self.disk.num_used
            tiers.append(snapshot("disk", self.disk.capacity, used, size, self.disk_stats))
        return tiers

    def check_integrity(self, device_hashes: set[int], swapped: set[str]) -> None:
        """AssertionError unless every hash has one copy, each tier is consistent and the
        host holds exactly the `swapped` sequences."""
        assert not self._spills, "spills queued outside an allocation"
        self.host.check_integrity()
        assert self.host.parked_ids() == swapped, "swapped sequences differ from the host's"
        host = self.host.hashes()
        assert not host & device_hashes, "a hash is cached on both the device and the host"
        if self.disk is not None:
            self.disk.check_integrity()
            disk = self.disk.hashes()
            assert not disk & device_hashes, "a hash is cached on both the device and disk"
            assert not disk & host, "a hash is cached on both the host and disk"
