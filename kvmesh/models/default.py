"""The embedded default model: a `test`-size Llama (seed 0) built once and cached on disk.

Location: `$KVMESH_CACHE_DIR/models/<DEFAULT_MODEL_NAME>`, or `~/.cache/kvmesh/models/...` when
the variable is unset. The folder is built in a temporary sibling and renamed into place under
an exclusive `fcntl` lock, so concurrent processes build it once and never see it half-written:
if the final folder exists, it is complete. Waiting for another process's build is bounded
(`TimeoutError` naming the lock file).
"""

from __future__ import annotations

import fcntl
import os
import tempfile
import time
from pathlib import Path

from kvmesh.engine.errors import InvalidParameterError
from kvmesh.models.tiny import build_tiny_model, remove_checkpoint

DEFAULT_ARCH, DEFAULT_SIZE, DEFAULT_SEED = "llama", "test", 0
# Bump the version whenever the builder's output changes, so stale caches are not reused.
DEFAULT_MODEL_NAME = f"tiny-{DEFAULT_ARCH}-{DEFAULT_SIZE}-seed{DEFAULT_SEED}-v1"
CACHE_DIR_ENV = "KVMESH_CACHE_DIR"
BUILD_LOCK_TIMEOUT_SECONDS = 300.0  # far above one build (seconds on a CPU)


def cache_root() -> Path:
    """`$KVMESH_CACHE_DIR`, or `~/.cache/kvmesh` when unset or empty."""
    configured = os.environ.get(CACHE_DIR_ENV, "")
    return Path(configured) if configured else Path.home() / ".cache" / "kvmesh"


def default_model_path(lock_timeout: float = BUILD_LOCK_TIMEOUT_SECONDS) -> Path:
    """Return the cached default checkpoint folder, building it first if it does not exist."""
    models_dir = cache_root() / "models"
    final = models_dir / DEFAULT_MODEL_NAME
    if final.is_dir():
        return final
    models_dir.mkdir(parents=True, exist_ok=True)
    lock_path = models_dir / f".{DEFAULT_MODEL_NAME}.lock"
    with open(lock_path, "w") as lock:
        _lock_exclusive(lock.fileno(), lock_path, lock_timeout)
        try:
            if not final.is_dir():
                _build_atomically(models_dir, final)
        finally:
            fcntl.flock(lock.fileno(), fcntl.LOCK_UN)
    return final


def _lock_exclusive(fd: int, path: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() >= deadline:
                raise TimeoutError(
                    f"{path}: another process held the default-model build lock for {timeout} s"
                ) from None
            time.sleep(0.05)


def _build_atomically(models_dir: Path, final: Path) -> None:
    staging = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=models_dir))
    try:
        build_tiny_model(staging, DEFAULT_ARCH, DEFAULT_SIZE, DEFAULT_SEED)
        os.rename(staging, final)
    finally:
        remove_checkpoint(staging)


def resolve_model_path(model: str | os.PathLike[str] | None) -> Path:
    """The checkpoint folder a command should load: `model`, or the default model when None.

    Raises InvalidParameterError("model", ...) when the folder has no config.json.
    """
    if model is None:
        return default_model_path()
    path = Path(model)
    if not (path / "config.json").is_file():
        raise InvalidParameterError(
            "model", f"{str(path)!r} is not a checkpoint folder (no config.json)"
        )
    return path
