"""Build, cache and load the fused CPU kernel library.

The C++ sources (`csrc/*.cpp`: paged attention, KV write, RMSNorm, the native executor's fused
elementwise ops and GEMM, the decode-step programs that replay them, and the benchmarks' paged
K/V read; plain C ABI + OpenMP, no torch headers) are compiled into one library with
`torch.utils.cpp_extension.load` and published as
`$KVMESH_CACHE_DIR/torch_extensions/<key>/kvmesh_cpu.so` (default `~/.cache/kvmesh`). The key
hashes the sources and headers, the compiler flags, the torch and Python versions and the
machine architecture, which with the flags fixes the ISA the code is compiled for (the baseline
of the architecture: the AVX2/AVX-512 paths are chosen at run time by the CPU's features), so
one build serves every CPU of the architecture and a cache built into an image works on any
host; the compiler's version is not part of it.

A published library is complete: it is compiled in `<key>/build/`, loaded and checked there,
copied to a temporary name and renamed into place, so a reader never sees a half-written file
and loads it without running the compiler. Builders serialize on an `fcntl` lock beside the
folder (released by the OS if a builder dies); the one that gets it second finds the library
published. Workers build it before they report ready (`kvmesh.engine.warmup`), `scripts/install.sh`
at install (`kvmesh kernels build`). Any failure in `library()` logs one warning and leaves the
library unavailable; callers fall back to the torch reference. `KVMESH_CPU_KERNEL=0` disables it.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import hashlib
import logging
import os
import platform
import shutil
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

logger = logging.getLogger(__name__)

ENV_DISABLE = "KVMESH_CPU_KERNEL"
CACHE_DIR_ENV = "KVMESH_CACHE_DIR"
SOURCE = Path(__file__).with_name("csrc") / "cpu_paged_attention.cpp"
SOURCES = (
    SOURCE,
    SOURCE.with_name("cpu_cache_ops.cpp"),
    SOURCE.with_name("cpu_fused_ops.cpp"),
    SOURCE.with_name("cpu_sampling.cpp"),
    SOURCE.with_name("cpu_gemm.cpp"),
    SOURCE.with_name("cpu_kv_read.cpp"),
    SOURCE.with_name("cpu_program.cpp"),
)  # compiled into one library
HEADERS = (
    SOURCE.with_name("dtype_convert.h"),
    SOURCE.with_name("fused_common.h"),
    SOURCE.with_name("cpu_attention_avx512.h"),
    SOURCE.with_name("cpu_gemm_tiles.h"),
    SOURCE.with_name("cpu_gemm_amx.h"),
)  # in the key
CFLAGS = ("-O3", "-fopenmp", "-std=c++17", "-fno-math-errno")
LDFLAGS = ("-fopenmp",)
ENTRY = "kvmesh_cpu_paged_attention"
WRITE_ENTRY = "kvmesh_cpu_write_kv"
LIB_NAME = "kvmesh_cpu.so"
ISA_FLAGS = (
    "avx512f",
    "avx512bw",
    "avx512dq",
    "avx512vl",
    "avx512_bf16",
    "amx_bf16",
    "avx2",
    "fma",
    "f16c",
)

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
    """Cache key of a build of `source` (all sources, see sources_bytes) on this machine."""
    import torch

    parts = [
        hashlib.sha256(source).hexdigest(),
        " ".join(CFLAGS + LDFLAGS),
        torch.__version__,
        f"{sys.version_info.major}.{sys.version_info.minor}",
        platform.machine(),
    ]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


def _cpuinfo(field: str) -> str:
    """The first `field` line's value in /proc/cpuinfo ("" where there is none)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""
    line = next((ln for ln in text.splitlines() if ln.startswith(field)), "")
    return line.partition(":")[2].strip()


def isa_level() -> str:
    """The extensions of ISA_FLAGS this CPU has (from /proc/cpuinfo; empty elsewhere): which
    of the kernel's paths can run here (for reports; not part of the build key)."""
    have = set(_cpuinfo("flags").split())
    return ",".join(flag for flag in ISA_FLAGS if flag in have)


def has_amx() -> bool:
    """Whether this CPU has AMX bfloat16 tiles (oneDNN's fastest bfloat16 GEMM path)."""
    return "amx_bf16" in isa_level().split(",")


ISA_CAPS = ("KVMESH_CPU_KERNEL_ISA", "ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA")


def machine() -> dict[str, str]:
    """What a benchmark ran on: the CPU's model name and `isa_level()` ("unknown" where
    /proc/cpuinfo does not say), and `isa_caps` naming each set variable of `ISA_CAPS` that
    held the kernels (kvmesh's, torch's, oneDNN's) below the CPU's ISA."""
    found = {"cpu": _cpuinfo("model name") or "unknown", "isa": isa_level() or "unknown"}
    caps = [f"{name}={os.environ[name]}" for name in ISA_CAPS if os.environ.get(name)]
    if caps:
        found["isa_caps"] = ",".join(caps)
    return found


def isa_text(host: dict[str, str]) -> str:
    """A `machine()` result's ISA for a report line, with the caps it ran under."""
    caps = host.get("isa_caps")
    return f"{host['isa']}; capped: {caps}" if caps else host["isa"]


def published_path(key: str | None = None) -> Path:
    """Where the library of `key` (default: this build's) is published."""
    return cache_root() / (key or build_key(sources_bytes())) / LIB_NAME


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def build() -> Path:
    """Compile and publish the library unless it is published; returns the file to load (the
    checked build itself in the process that built it). Raises when the compiler or the
    library fails."""
    key = build_key(sources_bytes())
    final = published_path(key)
    if final.is_file():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    with _file_lock(cache_root() / f"{key}.lock"):
        if final.is_file():  # published while we waited
            return final
        logger.info("building the fused CPU kernels into %s (once per key)", final.parent)
        started = time.monotonic()
        built = _compile(key, final.parent / "build")
        _open(built)  # never publish a library that does not load
        _publish(built, final)
        logger.info("built the fused CPU kernels in %.1f s", time.monotonic() - started)
    return built


# Defined for a build without the GEMM's AMX path (cpu_gemm_amx.h), whose tile instructions an
# assembler older than binutils 2.36 does not take although the compiler does.
NO_AMX_FLAG = "-DKVMESH_NO_AMX"


def _compile(key: str, build_dir: Path) -> Path:
    """A fresh build in `build_dir` (whatever a dead builder left there is removed first); when
    it fails, once more without the AMX path, so that an old assembler costs that path only."""
    try:
        return _compile_with(f"kvmesh_cpu_attn_{key}", build_dir, CFLAGS)
    except Exception as exc:  # an assembler without the tile instructions: retried once
        if not _refused_tiles(str(exc)):
            raise
        lines = str(exc).strip().splitlines()
        why = lines[-1] if lines else type(exc).__name__
        logger.info("CPU kernel build failed (%s); building again without the AMX path", why)
        built = _compile_with(f"kvmesh_cpu_attn_{key}_noamx", build_dir, (*CFLAGS, NO_AMX_FLAG))
        logger.warning("CPU kernels built without the GEMM's AMX path (first build: %s)", why)
        return built


def _refused_tiles(error: str) -> bool:
    """Whether a failed build's output says the assembler did not take an AMX instruction (any
    other failure is not retried: a source error, a full disk, an interrupted build)."""
    return "no such instruction" in error and any(
        name in error for name in ("tileloadd", "tilestored", "ldtilecfg", "tdpbf16ps", "tilezero")
    )


def _compile_with(name: str, build_dir: Path, cflags: tuple[str, ...]) -> Path:
    from torch.utils import cpp_extension

    shutil.rmtree(build_dir, ignore_errors=True)
    build_dir.mkdir(parents=True)
    path = cpp_extension.load(
        name=name,
        sources=[str(p) for p in SOURCES],
        extra_cflags=list(cflags),
        extra_ldflags=list(LDFLAGS),
        build_directory=str(build_dir),
        is_python_module=False,
        verbose=False,
    )
    return Path(path)


def _publish(built: Path, final: Path) -> None:
    """Copy `built` to `final` atomically (temporary file, fsync, rename)."""
    tmp = final.with_name(f".{final.name}.{os.getpid()}.tmp")
    shutil.copyfile(built, tmp)
    with open(tmp, "rb") as handle:
        os.fsync(handle.fileno())
    os.replace(tmp, final)


def load() -> ctypes.CDLL:
    """Build (unless published) and load the library; raises when that fails."""
    return _open(build())


def _open(path: Path) -> ctypes.CDLL:
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
                _state["lib"] = load()
            except Exception as exc:  # compiler missing, build error, load error
                logger.warning(
                    "fused CPU kernels unavailable, using the torch reference: %s",
                    str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__,
                )
                _state["lib"] = None
    return _state["lib"]  # type: ignore[return-value]


def available() -> bool:
    return library() is not None


def status() -> str:
    """Load the library now: "loaded", "disabled" (KVMESH_CPU_KERNEL=0) or "unavailable"."""
    if not enabled():
        return "disabled"
    return "loaded" if library() is not None else "unavailable"


def reset_for_tests() -> None:
    """Forget the loaded library and the environment switch (tests only)."""
    with _lock:
        _state.clear()
