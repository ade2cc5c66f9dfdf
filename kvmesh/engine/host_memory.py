"""How much host memory this process can still get: the host's MemAvailable, capped by what
its container's cgroup has left (the limit less the cgroup's working set)."""

from __future__ import annotations

import contextlib
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
# cgroup v2 file names, then v1's: (limit, usage, the inactive page cache's key in memory.stat)
CGROUP_FILES = (
    ("memory.max", "memory.current", "inactive_file"),
    ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes", "total_inactive_file"),
)
UNLIMITED = 1 << 60  # v1 writes "no limit" as about 2**63


def host_available_bytes(
    meminfo: Path = Path("/proc/meminfo"), cgroup_root: Path = CGROUP_ROOT
) -> int | None:
    """Bytes this process can still allocate: MemAvailable, capped by the cgroup's headroom;
    None where neither can be read."""
    found = [
        value
        for value in (_mem_available(meminfo), cgroup_headroom(cgroup_root))
        if value is not None
    ]
    return min(found) if found else None


def cgroup_headroom(root: Path = CGROUP_ROOT) -> int | None:
    """The cgroup's memory limit less its working set (usage less inactive page cache, as the
    kubelet counts it for eviction); None without a limit. Memory this process (the model's
    weights, say) and its siblings already hold counts against the limit."""
    for limit_name, usage_name, inactive_key in CGROUP_FILES:
        limit = _read_int(root / limit_name)
        if limit is None or limit >= UNLIMITED:
            continue
        usage = _read_int(root / usage_name) or 0
        inactive = _stat_value(root / Path(limit_name).parent / "memory.stat", inactive_key)
        working_set = max(0, usage - inactive)
        return max(0, limit - working_set)
    return None


def _mem_available(meminfo: Path) -> int | None:
    with contextlib.suppress(OSError, ValueError, IndexError), meminfo.open() as lines:
        for line in lines:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return None


def _read_int(path: Path) -> int | None:
    """The integer in `path`; None when unreadable or "max" (v2's no limit)."""
    with contextlib.suppress(OSError, ValueError):
        return int(path.read_text().strip())
    return None


def _stat_value(path: Path, key: str) -> int:
    with contextlib.suppress(OSError, ValueError, IndexError), path.open() as lines:
        for line in lines:
            name, _, value = line.partition(" ")
            if name == key:
                return int(value)
    return 0
