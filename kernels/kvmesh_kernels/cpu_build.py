"""Build and load the fused CPU kernel library on first use.

The C++ sources (`csrc/cpu_paged_attention.cpp`: paged attention; `csrc/cpu_cache_ops.cpp`: KV
write; plain C ABI + OpenMP, no torch headers) are compiled into one library with
`torch.utils.cpp_extension.load` into `$KVMESH_CACHE_DIR/torch_extensions/<key>` (default
`~/.cache/kvmesh/torch_extensions`), where the key hashes the sources, the compiler flags, the
torch and Python versions and the machine architecture. Concurrent processes serialize on an
`fcntl` lock beside that folder (released by the OS if a builder dies, unlike torch's own lock
file, which is removed here when stale). Any failure logs one warning and leaves the library
unavailable; callers fall back to the torch reference. `KVMESH_CPU_KERNEL=0` disables it.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import hashlib
import logging
import os
import platform
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

logger = logging.getLogger(__name__)

ENV_DISABLE = "KVMESH_CPU_KERNEL"
CACHE_DIR_ENV = "KVMESH_CACHE_DIR"
SOURCE = Path(__file__).with_name("csrc") / "cpu_paged_attention.cpp"
SOURCES = (
    SOURCE,
    SOURCE.with_name("cpu_cache_ops.cpp"),
    SOURCE.with_name("cpu_rms_norm.cpp"),
)  # compiled into one library
HEADERS = (SOURCE.with_name("dtype_convert.h"),)  # included by the sources; part of the key
CFLAGS = ("-O3", "-fopenmp", "-std=c++17", "-fno-math-errno")
LDFLAGS = ("-fopenmp",)
ENTRY = "kvmesh_cpu_paged_attention"
WRITE_ENTRY = "kvmesh_cpu_write_kv"

_lock = threading.Lock()
_state: dict[str, object] = {}


def enabled() -> bool:
    """False when KVMESH_CPU_KERNEL is 0/false/off (read once)."""
    if "enabled" not in _state:
        value = os.environ.get(ENV_DISABLE, "1").strip().lower()
        _state["enabled"] = value not in ("0", "false", "off", "no")
    return bool(_state["enabled"])


def cache_root() -> Path:
    base = os.environ.get(CACHE_DIR_ENV) or str(Path.home() / ".cache" / "kvmesh")
    return Path(base) / "torch_extensions"


def sources_bytes() -> bytes:
    """Every source's and header's name and contents, in order (what the build key hashes)."""
    return b"\0".join(p.name.encode() + b"\0" + p.read_bytes() for p in (*SOURCES, *HEADERS))


def build_key(source: bytes) -> str:
    """Cache key of a build of `source` (all sources, see sources_bytes) with these flags."""
    import torch

    parts = [
        hashlib.sha256(source).hexdigest(),
        " ".join(CFLAGS + LDFLAGS),
        torch.__version__,
        f"{sys.version_info.major}.{sys.version_info.minor}",
        platform.machine(),
    ]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _build() -> ctypes.CDLL:
    from torch.utils import cpp_extension

    key = build_key(sources_bytes())
    root = cache_root()
    build_dir = root / key
    build_dir.mkdir(parents=True, exist_ok=True)
    with _file_lock(root / f"{key}.lock"):
        # Under our lock nobody else is building, so a leftover torch lock file is stale.
        (build_dir / "lock").unlink(missing_ok=True)
        path = cpp_extension.load(
            name=f"kvmesh_cpu_attn_{key}",
            sources=[str(p) for p in SOURCES],
            extra_cflags=list(CFLAGS),
            extra_ldflags=list(LDFLAGS),
            build_directory=str(build_dir),
            is_python_module=False,
            verbose=False,
        )
    lib = ctypes.CDLL(str(path))
    for entry in (ENTRY, WRITE_ENTRY):
        func = getattr(lib, entry)
        func.argtypes = [ctypes.c_void_p]
        func.restype = ctypes.c_int
    return lib


def library() -> ctypes.CDLL | None:
    """The loaded library, building it on first call; None when disabled or unavailable."""
    if not enabled():
        return None
    if "lib" in _state:
        return _state["lib"]  # type: ignore[return-value]
    with _lock:
        if "lib" not in _state:
            try:
                _state["lib"] = _build()
            except Exception as exc:  # compiler missing, build error, load error
                logger.warning(
                    "fused CPU attention kernel unavailable, using the torch reference: %s",
                    str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__,
                )
                _state["lib"] = None
    return _state["lib"]  # type: ignore[return-value]


def available() -> bool:
    return library() is not None


def reset_for_tests() -> None:
    """Forget the loaded library and the environment switch (tests only)."""
    with _lock:
        _state.clear()
