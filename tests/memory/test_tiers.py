"""Host and disk tiers under a real CPU cache: spill and reload, damaged files, restart, swap."""

from __future__ import annotations

import shutil
import stat
import time
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch
from kvmesh_kernels.cache import KVCacheSpec, allocate_kv_cache

from kvmesh.memory.errors import SequenceExistsError
from kvmesh.memory.tiers import blockfile
from kvmesh.memory.tiers.blockfile import BlockMeta
from kvmesh.memory.tiers.device import DeviceBlocks
from kvmesh.memory.tiers.disk import DiskTier
from kvmesh.memory.tiers.host import HostTier
from kvmesh.memory.tiers.store import TieredStore
from kvmesh.memory.tiers.watermarks import Watermarks
from tests.memory.tiers_harness import TieredRig, file_size_limit

A = list(range(1, 14))  # 3 full blocks of 4 and one token
B = list(range(50, 63))


def push_down(rig: TieredRig, *prompts: list[int]) -> None:
    """Run and free each prompt in turn (evicting what came before)."""
    for index, tokens in enumerate(prompts):
        seq_id = f"push{index}-{tokens[0]}"
        assert rig.run_prompt(seq_id, tokens) is not None
        rig.manager.free(seq_id)


def test_evicted_prefix_spills_to_host_and_reloads(tmp_path: Path) -> None:
    rig = TieredRig(4, 8)
    push_down(rig, A, B)  # B evicts A's blocks: they spill instead of vanishing
    host = rig.store.metrics()[0]
    assert host.spills >= 3 and host.used_blocks >= 3
    assert rig.run_prompt("again", A) == 12  # the whole cached prefix, reloaded
    assert rig.store.metrics()[0].hits == 3
    rig.manager.check_integrity()
    rig.manager.free("again")
    rig.manager.check_integrity()


def _files(folder: Path) -> list[Path]:
    return sorted(folder.glob("*.kvblock"))


def test_host_overflow_goes_to_disk_and_reloads(tmp_path: Path) -> None:
    rig = TieredRig(4, 2, tmp_path, 8)
    push_down(rig, A, B)
    assert len(_files(tmp_path)) >= 1
    assert rig.run_prompt("again", A) == 12
    snapshot = {s.tier: s for s in rig.store.metrics()}
    assert snapshot["disk"].hits >= 1 and snapshot["host"].hits >= 1
    rig.manager.check_integrity()


@pytest.mark.parametrize("damage", ["flip", "truncate", "header"])
def test_damaged_disk_file_is_a_miss(tmp_path: Path, damage: str) -> None:
    rig = TieredRig(4, 1, tmp_path, 8)
    push_down(rig, A, B)
    first = _files(tmp_path)
    assert first
    for path in first:
        raw = bytearray(path.read_bytes())
        if damage == "truncate":
            raw = raw[: len(raw) - 7]
        elif damage == "flip":
            raw[-3] ^= 0x01
        else:
            raw[20] ^= 0x01
        path.write_bytes(bytes(raw))
    cached = rig.run_prompt("again", A)  # verify() inside proves no damaged KV was read
    assert cached is not None and cached < 12
    disk = rig.store.metrics()[1]
    assert disk.corrupt >= 1
    assert not any(p.exists() for p in first if disk.corrupt)  # a bad file is deleted
    rig.manager.check_integrity()


@pytest.mark.parametrize("persist", [True, False])
def test_restart_keeps_disk_blocks_only_when_persistent(tmp_path: Path, persist: bool) -> None:
    rig = TieredRig(4, 1, tmp_path, 16, persist=True)
    push_down(rig, A, B, list(range(80, 93)))
    kept = len(_files(tmp_path))
    assert kept >= 3
    rig.close()
    (tmp_path / "junk.kvblock").write_bytes(b"not a block")
    again = TieredRig(4, 1, tmp_path, 16, persist=persist)
    assert "junk.kvblock" not in {p.name for p in _files(tmp_path)}
    cached = again.run_prompt("after", A)
    assert (cached or 0) > 0 if persist else cached == 0
    if persist:
        assert again.store.metrics()[1].hits >= 1
    again.manager.check_integrity()


def test_swap_out_and_back_in_restores_the_sequence() -> None:
    rig = TieredRig(4, 4)
    assert rig.run_prompt("victim", A) == 0
    assert rig.manager.swap_out("victim")
    assert not rig.manager.has("victim") and rig.manager.is_swapped("victim")
    push_down(rig, B)  # overwrites the device blocks the victim held
    assert rig.manager.swap_in("victim")
    rig.store.prepare_step()
    rig.verify("victim", A)
    rig.manager.check_integrity()
    assert rig.store.swap_stats.swapped_in == 1


def test_a_swapped_in_sequence_publishes_its_blocks_again() -> None:
    """Swapped out, a sequence's published blocks are evicted by another prompt. Swapped back
    in onto fresh blocks, its next commit walks its chain from the first block, so its blocks
    are published again and another request hits all of them on the device (before, only its
    newest block was published, after a parent publication long gone: no lookup reached it)."""
    rig = TieredRig(4, 8)
    manager = rig.manager
    assert rig.run_prompt("victim", A) == 0
    assert manager.swap_out("victim")
    push_down(rig, B)  # evicts the victim's published blocks
    assert manager.swap_in("victim")
    rig.store.prepare_step()
    grown = [*A, 70, 71, 72]
    assert manager.allocate("victim", len(grown)) is not None
    rig.write("victim", grown, len(A))
    manager.commit("victim", grown, len(grown))
    assert manager.lookup_prefix("probe", [*grown, 73]) == 16
    assert manager.block_table("probe") == manager.block_table("victim")
    rig.verify("probe", grown)
    manager.check_integrity()


def _collides(parent: int | None, tokens: Sequence[int], extra_key: bytes | None) -> int:
    """A block hash anyone can collide: blocks of equal token sums after one parent."""
    return (parent or 0) * 1000 + sum(tokens) + 1


@pytest.mark.parametrize("tier", ["host", "disk"])
def test_a_forced_collision_is_a_miss_below_the_device_too(tmp_path: Path, tier: str) -> None:
    """Blocks x after p1 and x after p2 (p1 != p2, equal hashes) hash alike. On the device
    the second is a miss (its parent publication differs); kept on the host or on disk, x
    after p1 has no publication to check, and its prefix digest refuses it instead: the lookup
    after p2 hits p2 only and computes x (verify() reads back only its own context's KV)."""
    disk = tmp_path if tier == "disk" else None
    rig = TieredRig(3, 8 if disk is None else 1, disk, 8, hash_fn=_collides)
    p1, p2, x = [1, 2, 3, 4], [4, 3, 2, 1], [5, 5, 5, 5]
    push_down(rig, [*p1, *x, 9])
    rig.manager.evict_all()  # p1 and x after it go below the device
    assert rig.store.contains(_collides(_collides(None, p1, None), x, None))
    push_down(rig, [*p2, 9])  # p2 published on the device, under p1's hash
    assert rig.run_prompt("b", [*p2, *x, 9]) == 4
    rig.manager.check_integrity()
    rig.close()


def test_swap_out_refused_when_the_host_is_full() -> None:
    rig = TieredRig(4, 2)
    assert rig.run_prompt("victim", A) is not None
    assert not rig.manager.swap_out("victim")  # 4 blocks, 2 host slots: nothing changed
    rig.verify("victim", A)
    rig.manager.check_integrity()


def test_swapped_out_id_refuses_a_second_table() -> None:
    """While a sequence is swapped out, lookup_prefix, allocate and fork refuse its id and
    change nothing; swap_in then brings its own table and KV back."""
    rig = TieredRig(8, 8)
    manager = rig.manager
    assert rig.run_prompt("victim", A) == 0
    assert rig.run_prompt("other", B) == 0
    assert manager.swap_out("victim")
    free = manager.num_free_blocks
    for create in (
        lambda: manager.lookup_prefix("victim", A),
        lambda: manager.allocate("victim", len(A)),
        lambda: manager.fork("other", "victim"),
    ):
        with pytest.raises(SequenceExistsError, match="'victim'"):
            create()
        assert manager.num_free_blocks == free and not manager.has("victim")
        manager.check_integrity()
    assert manager.swap_in("victim")
    rig.store.prepare_step()
    rig.verify("victim", A)
    manager.check_integrity()


def test_integrity_check_detects_a_live_table_beside_its_swapped_copy() -> None:
    """check_integrity names an id held both as a device table and as swapped out."""
    rig = TieredRig(8, 8)
    assert rig.run_prompt("victim", A) == 0
    assert rig.manager.swap_out("victim")
    rig.manager._seqs["victim"] = rig.manager._swapped["victim"]
    with pytest.raises(AssertionError, match=r"\['victim'\]: a live table and a swapped"):
        rig.manager.check_integrity()


def test_block_file_round_trip_and_rejections() -> None:
    meta = BlockMeta(2**100 + 5, None, (1, 2, 3), b"k", bytes(range(32)))
    layout = {"dtype": "float32"}
    data = blockfile.encode(meta, layout, b"\x01" * 64)
    decoded = blockfile.decode(data, layout, meta.block_hash, 64)
    assert decoded is not None and decoded[0] == meta and bytes(decoded[1]) == b"\x01" * 64
    assert blockfile.decode(data, {"dtype": "float16"}, meta.block_hash, 64) is None
    assert blockfile.decode(data, layout, meta.block_hash + 1, 64) is None
    assert blockfile.decode(data[:-1], layout, meta.block_hash, 64) is None
    assert blockfile.decode(blockfile.MAGIC + data[8:20], layout, meta.block_hash, 64) is None


def test_prefetch_moves_disk_blocks_to_the_host_before_the_lookup(tmp_path: Path) -> None:
    rig = TieredRig(4, 6, tmp_path, 8)  # reads in flight are bounded by half the host
    push_down(rig, A, B, list(range(80, 93)))
    hashes = rig.manager.block_hashes(A)
    on_disk = [h for h in hashes if h in rig.store.disk]  # type: ignore[operator]
    assert on_disk and rig.store.prefetch(hashes) == len(on_disk)
    for future in list(rig.store._reads.values()):
        future.result(timeout=10)  # the background reads finish (bounded wait)
    rig.store.prepare_step()  # the engine's next step collects them into the host tier
    assert all(h in rig.store.host for h in on_disk)
    assert rig.run_prompt("again", A) == 12
    disk = rig.store.metrics()[1]
    assert disk.reloads == len(on_disk) and disk.hits == 0  # found on the host, not read now
    rig.manager.check_integrity()


def test_a_disk_folder_serves_one_engine_at_a_time(tmp_path: Path) -> None:
    rig = TieredRig(4, 2, tmp_path, 8)
    with pytest.raises(ValueError, match="in use by another process"):
        TieredRig(4, 2, tmp_path, 8)
    rig.close()
    TieredRig(4, 2, tmp_path, 8).close()  # released at close


def test_preemption_choice_by_estimated_cost() -> None:
    from kvmesh.memory.tiers.costs import PreemptionChooser, Rates

    rates = Rates()
    auto = PreemptionChooser("auto", 1 << 20, rates)
    assert not auto.prefers_swap(4, 1000)  # nothing measured yet: recompute
    rates.observe_copy(1 << 30, 0.1)  # 10 GiB/s
    rates.observe_compute(1000, 1.0)  # 1,000 tokens/s
    assert auto.prefers_swap(4, 1000)  # 0.8 ms of copies vs 1 s of prefill
    assert not auto.prefers_swap(40_000, 10)  # 7.8 s of copies vs 10 ms of prefill
    assert PreemptionChooser("swap", 1, rates).prefers_swap(10**9, 1)
    assert not PreemptionChooser("recompute", 1, rates).prefers_swap(1, 10**9)
    with pytest.raises(ValueError, match="preemption must be one of"):
        PreemptionChooser("never", 1, rates)


@pytest.mark.parametrize("disk", [False, True])
def test_block_evicted_before_its_reload_lands_keeps_the_right_kv(
    tmp_path: Path, disk: bool
) -> None:
    """A lookup claims a device block for a host reload, its sequence is then refused (no
    room), and the next lookup evicts that block before any step ran the reload: the host
    copy must come back, not the block's stale bytes under the reloaded hash."""
    rig = TieredRig(5, 3, tmp_path if disk else None, 6)
    push_down(rig, [7] * 5, [0, 1, 2, 3, 4])  # both first blocks cached on the device
    assert rig.run_prompt("big", [5, 6] * 6 + [5]) == 0  # 4 of 5 blocks: evicts [0..3]
    assert rig.run_prompt("refused-a", [0, 1, 2, 3, 4]) is None  # reload claimed, then no room
    assert rig.run_prompt("refused-b", [7] * 5) is None  # evicts the claimed block
    rig.manager.check_integrity()
    rig.manager.free("big")
    assert rig.run_prompt("zero", [0, 1, 2, 3, 4]) == 4  # verified: its own KV
    assert rig.run_prompt("sevens", [7] * 5) == 4
    rig.manager.check_integrity()


def test_swapped_in_sequence_freed_before_the_step_drops_its_copies() -> None:
    """A swapped-out sequence gets fresh blocks (its copies queued) and is then refused its
    first chunk and freed, as the scheduler does, before any step: a lookup that claims one of
    those blocks for a reload must read its own KV, not the swapped sequence's."""
    rig = TieredRig(4, 8)
    manager, store = rig.manager, rig.store
    prompt = [1, 2, 3, 4, 9]
    push_down(rig, prompt, list(range(20, 33)))  # the prompt's full block spills to the host
    assert rig.run_prompt("swapped", list(range(40, 47))) == 0
    assert manager.swap_out("swapped")
    assert manager.swap_in("swapped")  # two fresh blocks, their copies queued
    manager.free("swapped")  # refused its first chunk
    manager.check_integrity()
    cached = manager.lookup_prefix("again", prompt)
    assert cached == 4 and manager.allocate("again", len(prompt)) is not None
    store.prepare_step()
    rig.write("again", prompt, cached)
    rig.verify("again", prompt)
    manager.check_integrity()


def test_a_disk_that_refuses_writes_drops_blocks_without_failing(tmp_path: Path) -> None:
    """A disk write that fails (disk full; here a file size limit) costs the demoted blocks,
    not the allocation whose eviction demoted them: no exception, no stranded device block,
    no temporary file left behind, and a later lookup still reads its own KV."""
    rig = TieredRig(4, 1, tmp_path, 8)
    with file_size_limit(200):
        push_down(rig, A, B, list(range(80, 93)))
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")] == []
    host, disk = rig.store.metrics()
    assert host.dropped >= 2 and disk.used_blocks == disk.spills == 0 and not _files(tmp_path)
    rig.manager.check_integrity()
    assert rig.run_prompt("again", list(range(80, 93))) is not None  # verified: its own KV
    rig.manager.check_integrity()


def test_swap_traffic_is_counted_both_ways() -> None:
    """A swap-out writes a sequence's blocks into the host tier as its swap-in reads them back:
    the host's spills and moved bytes count the copies in, as its reloads count those out."""
    rig = TieredRig(4, 4)
    block_bytes = rig.device.block_bytes
    assert rig.run_prompt("victim", A) == 0
    before = rig.store.metrics()[0]
    assert rig.manager.swap_out("victim")
    out = rig.store.metrics()[0]
    assert (out.spills - before.spills, out.bytes_moved - before.bytes_moved) == (
        4,
        4 * block_bytes,
    )
    assert rig.manager.swap_in("victim")
    rig.store.prepare_step()
    back = rig.store.metrics()[0]
    assert (back.reloads - out.reloads, back.bytes_moved - out.bytes_moved) == (
        4,
        4 * block_bytes,
    )


def test_a_non_persistent_disk_tier_leaves_no_files_at_close(tmp_path: Path) -> None:
    """Without persistence a disk tier's files can never hit again (the next start deletes
    them): closing removes them, so a stopped worker does not hold its disk budget."""
    rig = TieredRig(4, 1, tmp_path, 8)
    push_down(rig, A, B)
    assert _files(tmp_path)
    rig.close()
    assert not _files(tmp_path)


def test_disk_reloads_report_their_latency(tmp_path: Path) -> None:
    """The disk tier's mean reload latency is measured, not a constant 0, once it reloads."""
    rig = TieredRig(4, 1, tmp_path, 8)
    push_down(rig, A, B)
    assert rig.run_prompt("again", A) == 12
    disk = rig.store.metrics()[1]
    assert disk.hits >= 1 and disk.reload_latency_mean_s > 0


def test_a_block_file_that_cannot_be_deleted_costs_only_that_block(tmp_path: Path) -> None:
    """Deleting a disk block can fail (read-only remount after I/O errors, permissions; here
    a directory in the file's place): the block is forgotten, the failure counted, the step
    goes on, and evicting more blocks through the disk tier still works."""
    rig = TieredRig(4, 1, tmp_path, 2)
    push_down(rig, A, B)
    stuck = _files(tmp_path)
    assert stuck
    for path in stuck:
        path.unlink()
        path.mkdir()
        (path / "keep").write_bytes(b"x")  # unlink(path) now fails: EISDIR
    assert rig.run_prompt("again", A) is not None  # misses on disk: recomputed, not failed
    rig.manager.free("again")
    push_down(rig, B, list(range(80, 93)), list(range(100, 113)))  # the disk tier evicts
    disk = rig.store.metrics()[1]
    assert rig.store.disk is not None and rig.store.disk.num_unremoved >= 1
    assert disk.used_blocks <= 2 and all(path.is_dir() for path in stuck)
    rig.manager.check_integrity()


def test_closing_a_disk_tier_whose_folder_is_gone_releases_it(tmp_path: Path) -> None:
    """close never raises: a folder removed under the tier (a temp cleaner, an I/O error on
    listing) still has its lock released."""
    folder = tmp_path / "kv"
    disk = DiskTier(folder, 4, {"layout": 1}, 16)
    shutil.rmtree(folder)
    disk.close()
    assert not disk._release.alive  # the finalizer ran: the lock's descriptor is closed


@pytest.mark.parametrize("entry", ["undeletable", "dangling link"])
def test_a_persistent_restart_survives_entries_it_cannot_read_or_delete(
    tmp_path: Path, entry: str
) -> None:
    """A persistent disk tier restarts on a folder holding a block entry that fails to verify
    and cannot be deleted (here a directory in the file's place), or a dangling link: the entry
    is dropped and counted, the good blocks are kept (before, the engine failed to start with
    a raw OSError on every restart)."""
    layout = {"layout": 1}
    first = DiskTier(tmp_path, 4, layout, 16, persist=True)
    assert first.put(BlockMeta(5, None, (1, 2), None, bytes(32)), bytes(16))
    first.close()
    bad = tmp_path / f"{7:032x}.kvblock"
    if entry == "undeletable":
        bad.mkdir()
        (bad / "keep").write_bytes(b"x")
    else:
        bad.symlink_to(tmp_path / "gone")
    again = DiskTier(tmp_path, 4, layout, 16, persist=True)
    try:
        assert 5 in again and 7 not in again and again.num_corrupt == 1
        assert again.num_unremoved == (entry == "undeletable")
        again.check_integrity()
    finally:
        again.close()


class FinishedCopy:
    """What `DeviceBlocks.from_host` returns on CUDA (a `DeviceCopy`), for a copy that has
    completed on the device and took `seconds` there: the CPU has no copy stream, so the
    copy itself runs at once and its completion is only seen when the store looks."""

    def __init__(self, seconds: float) -> None:
        self._seconds = seconds

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass

    def seconds(self) -> float:
        return self._seconds


COPY_SECONDS = 0.004  # what a FinishedCopy reports


@pytest.fixture
def cuda_like_copies(monkeypatch: pytest.MonkeyPatch) -> None:
    """Reload copies behave as on CUDA: asynchronous, in flight until the store sees them
    complete (the bytes land at once: the real CPU copy runs underneath)."""
    cpu_copy = DeviceBlocks.from_host

    def from_host(
        self: DeviceBlocks, host: HostTier, slots: Sequence[int], block_ids: Sequence[int]
    ) -> FinishedCopy:
        cpu_copy(self, host, slots, block_ids)
        return FinishedCopy(COPY_SECONDS)

    monkeypatch.setattr(DeviceBlocks, "from_host", from_host)


@pytest.mark.parametrize("path", ["cpu", "cuda"])
def test_reload_bandwidth_is_timed_from_the_copy_not_from_the_lookup(
    request: pytest.FixtureRequest, path: str
) -> None:
    """The copy bandwidth behind auto swap-or-recompute is sampled from a reload copy's own
    duration (on CUDA its events' elapsed time), not from when the lookup queued it: the wait
    until the step ran (here 50 ms) made the bandwidth look orders of magnitude lower, and
    auto chose recompute where swapping was far cheaper. The reload latency still counts
    from the lookup."""
    if path == "cuda":
        request.getfixturevalue("cuda_like_copies")
    rig = TieredRig(8, 8)
    store = rig.store
    push_down(rig, A)
    rig.manager.evict_all()  # A's 3 full blocks spill to the host
    store.flush_spills()
    assert rig.manager.lookup_prefix("again", A) == 12  # 3 reloads queued
    assert rig.manager.allocate("again", len(A)) is not None
    time.sleep(0.05)  # the lookup's schedule, then the step
    store.rates.bytes_per_s = None  # the reload's copy is the only sample
    before = (store.host_stats.copy_seconds, store.host_stats.reload_seconds)
    store.prepare_step()
    store.prepare_step()  # on CUDA a copy is seen complete at a later step
    copy_seconds = store.host_stats.copy_seconds - before[0]
    latency = store.host_stats.reload_seconds - before[1]
    size = 3 * rig.device.block_bytes
    timed = COPY_SECONDS if path == "cuda" else copy_seconds  # the copy's own time
    assert store.rates.bytes_per_s == pytest.approx(size / timed)
    assert copy_seconds == pytest.approx(timed) and store.host_stats.copy_bytes >= size
    assert latency >= 0.05 > copy_seconds and store.host_stats.reloads == 3
    rig.write("again", A, 12)
    rig.verify("again", A)
    rig.manager.check_integrity()


def _reloads_in_flight(rig: TieredRig) -> None:
    """3 of the host's 4 slots hold reload copies that completed on the device, seen by the
    store only at its next step (as on CUDA, where `prepare_step` polls them)."""
    push_down(rig, A)
    rig.manager.evict_all()  # A's 3 full blocks -> host
    assert rig.run_prompt("hit", A) == 12  # its step issues the 3 reloads
    host = rig.store.host
    assert (host.num_free, host.num_cached, len(host._inflight)) == (1, 0, 3)


@pytest.mark.usefixtures("cuda_like_copies")
def test_completed_reload_copies_leave_room_for_a_swap_out() -> None:
    """A swap-out before the next step counts the host slots of reload copies that already
    completed as free: it was refused (the sequence recomputed) though the host had room."""
    rig = TieredRig(8, 4)
    assert rig.run_prompt("victim", list(range(100, 106))) == 0  # 2 blocks
    _reloads_in_flight(rig)
    assert rig.manager.swap_out("victim")
    rig.manager.check_integrity()
    assert rig.manager.swap_in("victim")
    rig.store.prepare_step()
    rig.verify("victim", list(range(100, 106)))


@pytest.mark.usefixtures("cuda_like_copies")
def test_completed_reload_copies_leave_room_for_spills() -> None:
    """Evictions before the next step spill into the host slots of completed reload copies:
    before, the host looked full and a spill dropped a cached block."""
    rig = TieredRig(8, 4)
    _reloads_in_flight(rig)
    rig.manager.free("hit")
    rig.manager.evict_all()  # A's 3 published blocks spill: 1 free slot, 3 completed copies
    rig.store.flush_spills()
    host = rig.store.metrics()[0]
    assert host.dropped == 0 and rig.store.host.num_cached == 3
    assert rig.run_prompt("again", A) == 12  # verified: its own KV
    rig.manager.check_integrity()


def _one_block_store(tmp_path: Path, host_blocks: int, disk_blocks: int) -> TieredStore:
    """A store over a 4-block device cache whose block b holds bytes of value b + 1; no
    watermarks (only capacity moves blocks down)."""
    cache = allocate_kv_cache(KVCacheSpec(4, 1, 4, 1, 32))
    for block in range(4):
        cache.data[block] = block + 1
    device = DeviceBlocks(cache, "m")
    flat = Watermarks(1.0, 1.0)
    host = HostTier(host_blocks, device.data_bytes, watermarks=flat)
    disk = DiskTier(tmp_path, disk_blocks, device.layout, device.block_bytes, watermarks=flat)
    return TieredStore(device, host, disk)


D = BlockMeta(11, None, (1, 2, 3, 4), None, bytes(32))
E = BlockMeta(22, None, (5, 6, 7, 8), None, bytes([1]) * 32)


def test_a_disk_reload_never_evicts_itself_to_make_its_host_slot(tmp_path: Path) -> None:
    """A disk reload whose host slot is made by demoting a host block to a full disk: the
    block being reloaded leaves the disk first, so the demoted block takes its place. Before,
    the demotion evicted the very block being reloaded: counted both dropped and reloaded."""
    store = _one_block_store(tmp_path, host_blocks=1, disk_blocks=1)
    disk = store.disk
    assert disk is not None
    store.spill(0, D)  # D on the host
    store.flush_spills()
    store.spill(1, E)  # D demoted to the disk (1 block), E on the host
    store.flush_spills()
    assert disk.hashes() == {D.block_hash} and store.host.hashes() == {E.block_hash}
    assert store.take(D, 2)  # D read from disk; E demoted to make D's host slot
    store.prepare_step()
    assert torch.all(store.device.cache.data[2] == 1)  # D's bytes (device block 0's)
    stats = store.disk_stats
    assert (stats.hits, stats.reloads, stats.dropped) == (1, 1, 0)
    assert disk.hashes() == {E.block_hash} and len(_files(tmp_path)) == 1
    store.check_integrity({D.block_hash}, set())
    store.close()


def test_a_disk_reload_without_a_host_slot_leaves_the_block_on_disk(tmp_path: Path) -> None:
    """A disk reload that finds no host slot (every slot held by a swapped-out sequence)
    changes nothing: the block stays on disk, readable later."""
    store = _one_block_store(tmp_path, host_blocks=1, disk_blocks=2)
    disk = store.disk
    assert disk is not None
    store.spill(0, D)
    store.flush_spills()
    store.spill(1, E)  # D to the disk
    store.flush_spills()
    assert store.swap_out("s", [3])  # E to the disk, the one slot parked
    assert disk.hashes() == {D.block_hash, E.block_hash}
    assert not store.take(D, 2)
    assert disk.hashes() == {D.block_hash, E.block_hash} and store.disk_stats.dropped == 0
    store.check_integrity(set(), {"s"})
    store.drop_swapped("s")
    assert store.take(D, 2)
    store.prepare_step()
    assert torch.all(store.device.cache.data[2] == 1)
    store.close()


def test_an_unusable_hash_seed_fails_a_persistent_start_naming_the_folder(
    tmp_path: Path,
) -> None:
    """A persistent disk tier reads (or makes) the folder's hash seed at start. A seed that
    cannot be written (a full disk; here a file size limit) or read (a directory in its place)
    is a ValueError naming the folder (the engine reports it as `disk_kv_dir`), leaves no
    temporary file, and releases the folder; before, a raw OSError came out of the engine's
    start and a failed write left `hash-seed.tmp` behind."""
    full = tmp_path / "full"
    with file_size_limit(8), pytest.raises(ValueError, match=r"disk KV folder .* cannot be used"):
        DiskTier(full, 4, {"layout": 1}, 16, persist=True)
    assert sorted(p.name for p in full.iterdir()) == ["lock"]
    disk = DiskTier(full, 4, {"layout": 1}, 16, persist=True)  # released: starts once it can
    seed = (full / "hash-seed").read_bytes()
    assert disk.hash_seed() == seed and len(seed) == 16
    assert stat.S_IMODE((full / "hash-seed").stat().st_mode) == 0o600
    disk.close()
    unreadable = tmp_path / "unreadable"
    (unreadable / "hash-seed").mkdir(parents=True)
    with pytest.raises(ValueError, match="hash seed hash-seed cannot be read or written"):
        DiskTier(unreadable, 4, {"layout": 1}, 16, persist=True)
    DiskTier(unreadable, 4, {"layout": 1}, 16).close()  # the lock was released


def test_a_persistent_start_removes_torn_hash_seed_writes(tmp_path: Path) -> None:
    """A seed write cut short by a crash leaves its temporary file (under the old name or
    write_atomic's); the next persistent start removes it and keeps the seed."""
    (tmp_path / "hash-seed").write_bytes(b"s" * 16)
    for name in ("hash-seed.tmp", ".hash-seed.4242.tmp"):
        (tmp_path / name).write_bytes(b"torn")
    disk = DiskTier(tmp_path, 4, {"layout": 1}, 16, persist=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hash-seed", "lock"]
    assert disk.hash_seed() == b"s" * 16
    disk.close()
