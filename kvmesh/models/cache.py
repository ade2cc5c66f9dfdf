"""kvmesh's cache folder and building a folder in it exactly once.

`materialize(name, build)` returns `cache_root()/models/<name>`, calling `build(staging)` first
when the folder does not exist. The build writes into a temporary sibling that is renamed into
place under an exclusive `fcntl` lock, so concurrent processes build once and never see a
half-written folder: if the final folder exists, it is complete. A failed build leaves nothing
behind. Waiting for another process's build is bounded (`TimeoutError` naming the lock file). A
name that would not lie inside the models folder (an absolute path, an empty part, `.`, `..`) is
refused with ValueError before anything is made.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

CACHE_DIR_ENV = "KVMESH_CACHE_DIR"
BUILD_LOCK_TIMEOUT_SECONDS = 600.0  # far above one build (a GGUF conversion takes ~30 s on a CPU)


def cache_root() -> Path:
    """`$KVMESH_CACHE_DIR`, or `~/.cache/kvmesh` when unset or empty."""
    configured = os.environ.get(CACHE_DIR_ENV, "")
    return Path(configured) if configured else Path.home() / ".cache" / "kvmesh"


def models_dir() -> Path:
    """Where cached checkpoints live: `cache_root()/models`."""
    return cache_root() / "models"


def materialize(
    name: str,
    build: Callable[[Path], object],
    lock_timeout: float = BUILD_LOCK_TIMEOUT_SECONDS,
) -> Path:
    """`models_dir()/name`, built once by `build(staging_dir)` when missing (see module doc).
    `name` may hold a parent folder (`key/stem`): the lock and staging folder sit beside the
    final folder, inside that parent. ValueError for a name `checked_name` refuses."""
    final = models_dir() / checked_name(name)
    if final.is_dir():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    lock_path = final.parent / f".{final.name}.lock"
    with open(lock_path, "w") as lock:
        _lock_exclusive(lock.fileno(), lock_path, lock_timeout)
        try:
            if not final.is_dir():
                build_atomically(final, build)
        finally:
            fcntl.flock(lock.fileno(), fcntl.LOCK_UN)
    return final


def checked_name(name: str) -> str:
    """`name` when it names a folder strictly inside the models folder: relative, with
    `/`-separated parts that are neither empty nor `.` or `..`; else ValueError naming it."""
    parts = name.split("/")
    if any(part in ("", ".", "..") for part in parts):
        raise ValueError(f"name: {name!r} is not a folder inside {models_dir()}")
    return name


def _lock_exclusive(fd: int, path: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() >= deadline:
                raise TimeoutError(
                    f"{path}: another process held the model build lock for {timeout} s"
                ) from None
            time.sleep(0.05)


def build_atomically(final: Path, build: Callable[[Path], object]) -> None:
    """`build(staging)` in a temporary sibling of `final`, then renamed to `final` (which must
    not exist). On failure nothing is left. Unlocked: callers that may race hold a lock."""
    final.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
    try:
        build(staging)
        os.rename(staging, final)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
