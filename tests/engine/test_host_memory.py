"""The host-memory headroom checked at start: MemAvailable capped by the cgroup's limit less
its working set (files written in the kernel's own formats, v2 and v1)."""

from __future__ import annotations

from pathlib import Path

from kvmesh.engine.host_memory import cgroup_headroom, host_available_bytes

GIB = 1 << 30


def _meminfo(tmp_path: Path, available_kib: int) -> Path:
    path = tmp_path / "meminfo"
    path.write_text(
        f"MemTotal:       65536000 kB\nMemFree:        1000000 kB\n"
        f"MemAvailable:   {available_kib} kB\nBuffers:          20000 kB\n"
    )
    return path


def _cgroup_v2(root: Path, limit: str, current: int, inactive_file: int) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "memory.max").write_text(f"{limit}\n")
    (root / "memory.current").write_text(f"{current}\n")
    (root / "memory.stat").write_text(
        f"anon {current - inactive_file}\nfile {inactive_file}\nactive_file 0\n"
        f"inactive_file {inactive_file}\n"
    )
    return root


def test_cgroup_v2_headroom_subtracts_the_working_set(tmp_path: Path) -> None:
    # 8 GiB limit, 5 GiB used of which 1 GiB inactive page cache: 4 GiB working set.
    root = _cgroup_v2(tmp_path / "cg", str(8 * GIB), 5 * GIB, 1 * GIB)
    assert cgroup_headroom(root) == 4 * GIB
    meminfo = _meminfo(tmp_path, 60 * GIB // 1024)  # the host itself has 60 GiB free
    assert host_available_bytes(meminfo, root) == 4 * GIB


def test_cgroup_without_limit_leaves_meminfo(tmp_path: Path) -> None:
    root = _cgroup_v2(tmp_path / "cg", "max", 5 * GIB, 0)
    assert cgroup_headroom(root) is None
    assert host_available_bytes(_meminfo(tmp_path, 3 * GIB // 1024), root) == 3 * GIB


def test_cgroup_v1_headroom(tmp_path: Path) -> None:
    memory = tmp_path / "cg" / "memory"
    memory.mkdir(parents=True)
    (memory / "memory.limit_in_bytes").write_text(f"{6 * GIB}\n")
    (memory / "memory.usage_in_bytes").write_text(f"{3 * GIB}\n")
    (memory / "memory.stat").write_text(f"cache 100\ntotal_inactive_file {GIB}\n")
    assert cgroup_headroom(tmp_path / "cg") == 4 * GIB
    (memory / "memory.limit_in_bytes").write_text("9223372036854771712\n")  # v1's "no limit"
    assert cgroup_headroom(tmp_path / "cg") is None


def test_working_set_over_the_limit_leaves_nothing(tmp_path: Path) -> None:
    root = _cgroup_v2(tmp_path / "cg", str(2 * GIB), 3 * GIB, 0)
    assert cgroup_headroom(root) == 0
    assert host_available_bytes(_meminfo(tmp_path, 10 * GIB // 1024), root) == 0


def test_nothing_readable_is_none(tmp_path: Path) -> None:
    assert host_available_bytes(tmp_path / "none", tmp_path / "none") is None
