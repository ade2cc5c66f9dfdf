"""Build cache, fallback and switch of the fused CPU kernel (no compilation here)."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import kvmesh_kernels
import pytest
import torch
from dense_reference import random_paged_cache
from kvmesh_kernels import cpu_build, dispatch, paged_decode_attention
from kvmesh_kernels.reference_attention import torch_paged_decode_attention


@pytest.fixture
def fresh_state() -> Iterator[None]:
    saved = dict(cpu_build._state)
    cpu_build.reset_for_tests()
    yield
    cpu_build._state.clear()
    cpu_build._state.update(saved)
    kvmesh_kernels.set_backend(None)


def test_import_does_not_build_or_import_torch() -> None:
    code = (
        "import sys, kvmesh_kernels; "
        "print('torch' in sys.modules, 'kvmesh_kernels.cpu_build' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]


def test_build_key_changes_with_source_and_flags_and_cache_dir_follows_env(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    assert cpu_build.build_key(b"a") != cpu_build.build_key(b"b")
    assert cpu_build.build_key(b"a") == cpu_build.build_key(b"a")
    key = cpu_build.build_key(b"a")
    monkeypatch.setattr(cpu_build, "CFLAGS", (*cpu_build.CFLAGS, "-march=native"))
    assert cpu_build.build_key(b"a") != key
    assert set(cpu_build.isa_level().split(",")) <= {"", *cpu_build.ISA_FLAGS}
    assert cpu_build.machine()["isa"] in (cpu_build.isa_level(), "unknown")
    assert cpu_build.HEADERS[-1].is_file() and cpu_build.HEADERS[-1].name.endswith(".h")
    assert cpu_build.HEADERS[0].name.encode() in cpu_build.sources_bytes()
    monkeypatch.setenv(cpu_build.CACHE_DIR_ENV, str(tmp_path))
    assert cpu_build.cache_root() == tmp_path / "torch_extensions"
    assert cpu_build.SOURCE.is_file()


def test_env_switch_disables_kernel(monkeypatch: pytest.MonkeyPatch, fresh_state: None) -> None:
    monkeypatch.setenv(cpu_build.ENV_DISABLE, "0")
    assert not cpu_build.enabled() and cpu_build.library() is None


def test_build_failure_warns_once_and_falls_back(
    monkeypatch: pytest.MonkeyPatch,
    fresh_state: None,
    caplog: pytest.LogCaptureFixture,
    tmp_path: Path,
) -> None:
    monkeypatch.setenv(cpu_build.ENV_DISABLE, "1")
    monkeypatch.setenv(cpu_build.CACHE_DIR_ENV, str(tmp_path))
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    pc = random_paged_cache([12, 3], num_kv_heads=1, head_dim=64, block_size=8)
    query = torch.randn(2, 2, 64)  # [batch, Hq, D]
    layer = pc.cache.layer(0)
    kvmesh_kernels.set_backend("torch")
    with caplog.at_level(logging.WARNING, logger=cpu_build.__name__):
        for _ in range(3):
            out = paged_decode_attention(query, layer, pc.block_tables, pc.seq_lens, scale=0.1)
    warnings = [
        r for r in caplog.records if r.name == cpu_build.__name__ and r.levelno >= logging.WARNING
    ]
    assert len(warnings) == 1  # one build attempt, then the reference serves
    assert "unavailable" in warnings[0].getMessage()
    assert not any(tmp_path.rglob(cpu_build.LIB_NAME))  # nothing published
    ref = torch_paged_decode_attention(query, layer, pc.block_tables, pc.seq_lens, scale=0.1)
    assert torch.equal(out, ref)
    assert dispatch._fused_cpu(query, layer) is None


def test_a_build_that_fails_is_retried_once_without_the_amx_path(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
    """An assembler older than binutils 2.36 refuses the AMX tile instructions (not runnable
    here: the compile is stood in for): the second build defines KVMESH_NO_AMX and is kept."""
    calls: list[tuple[str, ...]] = []

    def compile_with(name: str, build_dir: Path, cflags: tuple[str, ...]) -> Path:
        calls.append(cflags)
        if cpu_build.NO_AMX_FLAG not in cflags:
            raise RuntimeError("Error building extension\nno such instruction: `tileloadd'")
        return tmp_path / "built.so"

    monkeypatch.setattr(cpu_build, "_compile_with", compile_with)
    with caplog.at_level(logging.INFO, logger=cpu_build.__name__):
        assert cpu_build._compile("key", tmp_path / "build") == tmp_path / "built.so"
    assert calls == [cpu_build.CFLAGS, (*cpu_build.CFLAGS, cpu_build.NO_AMX_FLAG)]
    assert "without the GEMM's AMX path" in caplog.text and "tileloadd" in caplog.text


def test_any_other_build_failure_is_not_retried(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A source error or a full disk is raised as it is: no second build, no AMX path lost."""
    calls: list[tuple[str, ...]] = []

    def compile_with(name: str, build_dir: Path, cflags: tuple[str, ...]) -> Path:
        calls.append(cflags)
        raise RuntimeError("Error building extension\nNo space left on device")

    monkeypatch.setattr(cpu_build, "_compile_with", compile_with)
    with pytest.raises(RuntimeError, match="No space left"):
        cpu_build._compile("key", tmp_path / "build")
    assert calls == [cpu_build.CFLAGS]


def test_the_no_amx_define_builds_the_gemm_without_its_amx_path(tmp_path: Path) -> None:
    """The GEMM's source compiled with the retry's define has no AMX code; without it (GCC 11
    or later on Linux) it has."""
    cxx = shutil.which(os.environ.get("CXX", "c++"))
    nm = shutil.which("nm")
    if cxx is None or nm is None:
        pytest.skip("no C++ compiler or nm here")
    source = cpu_build.SOURCE.with_name("cpu_gemm.cpp")

    def amx_symbols(*flags: str) -> bool:
        obj = tmp_path / "gemm.o"
        command = [cxx, "-O0", "-fopenmp", "-std=c++17", *flags, "-c", str(source), "-o", str(obj)]
        subprocess.run(command, check=True, capture_output=True, timeout=300)
        out = subprocess.run([nm, "-C", str(obj)], check=True, capture_output=True, text=True)
        return "amx::" in out.stdout

    assert not amx_symbols(cpu_build.NO_AMX_FLAG)
    banner = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout
    version = subprocess.run([cxx, "-dumpversion"], capture_output=True, text=True).stdout
    gcc_11 = "clang" not in banner.lower() and int(version.split(".")[0] or 0) >= 11
    if sys.platform == "linux" and gcc_11:
        assert amx_symbols()


BUILD_AND_REPORT = """
import json, logging, sys
logging.basicConfig(level=logging.INFO, stream=sys.stderr)
from kvmesh_kernels import cpu_build
# the lock and publishing are under test, not the code's speed: no optimisation
cpu_build.CFLAGS = ("-O0", *(f for f in cpu_build.CFLAGS if not f.startswith("-O")))
status = cpu_build.status()
print(json.dumps({"status": status, "published": str(cpu_build.published_path())}))
"""


@pytest.mark.slow
def test_two_processes_building_into_one_fresh_cache_both_load_one_build(tmp_path: Path) -> None:
    """Started together on an empty cache folder: one compiles and publishes, the other waits
    on the lock and loads the published library; no temporary file is left behind."""
    env = {**os.environ, cpu_build.CACHE_DIR_ENV: str(tmp_path), cpu_build.ENV_DISABLE: "1"}
    procs = [
        subprocess.Popen([sys.executable, "-c", BUILD_AND_REPORT], env=env, text=True,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        for _ in range(2)
    ]  # fmt: skip
    results = [proc.communicate(timeout=280) for proc in procs]
    assert [proc.returncode for proc in procs] == [0, 0], results[0][1][-2000:]
    reports = [json.loads(out.strip().splitlines()[-1]) for out, _ in results]
    assert [r["status"] for r in reports] == ["loaded", "loaded"]
    published = Path(reports[0]["published"])
    assert reports[1]["published"] == str(published) and published.is_file()
    assert sum("building the fused CPU kernels" in err for _, err in results) == 1
    assert [p.name for p in published.parent.iterdir() if p.is_file()] == [cpu_build.LIB_NAME]


def test_machine_names_the_isa_caps_a_benchmark_ran_under(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in cpu_build.ISA_CAPS:
        monkeypatch.delenv(name, raising=False)
    assert "isa_caps" not in cpu_build.machine()
    monkeypatch.setenv("KVMESH_CPU_KERNEL_ISA", "avx2")
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    assert cpu_build.machine()["isa_caps"] == "KVMESH_CPU_KERNEL_ISA=avx2,ONEDNN_MAX_CPU_ISA=AVX2"
