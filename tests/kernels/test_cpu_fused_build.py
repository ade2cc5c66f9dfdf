"""Build cache, fallback and switch of the fused CPU kernel (no compilation here)."""

from __future__ import annotations

import logging
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


def test_build_key_changes_with_source_and_cache_dir_follows_env(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    assert cpu_build.build_key(b"a") != cpu_build.build_key(b"b")
    assert cpu_build.build_key(b"a") == cpu_build.build_key(b"a")
    monkeypatch.setenv(cpu_build.CACHE_DIR_ENV, str(tmp_path))
    assert cpu_build.cache_root() == tmp_path / "torch_extensions"
    assert cpu_build.SOURCE.is_file()


def test_env_switch_disables_kernel(monkeypatch: pytest.MonkeyPatch, fresh_state: None) -> None:
    monkeypatch.setenv(cpu_build.ENV_DISABLE, "0")
    assert not cpu_build.enabled() and cpu_build.library() is None


def test_build_failure_warns_once_and_falls_back(
    monkeypatch: pytest.MonkeyPatch, fresh_state: None, caplog: pytest.LogCaptureFixture
) -> None:
    calls = []

    def broken() -> None:
        calls.append(1)
        raise RuntimeError("Error building extension: g++ not found")

    monkeypatch.setenv(cpu_build.ENV_DISABLE, "1")
    monkeypatch.setattr(cpu_build, "_build", broken)
    pc = random_paged_cache([12, 3], num_kv_heads=1, head_dim=64, block_size=8)
    query = torch.randn(2, 2, 64)  # [batch, Hq, D]
    layer = pc.cache.layer(0)
    kvmesh_kernels.set_backend("torch")
    with caplog.at_level(logging.WARNING, logger=cpu_build.__name__):
        for _ in range(3):
            out = paged_decode_attention(query, layer, pc.block_tables, pc.seq_lens, scale=0.1)
    assert len(calls) == 1
    assert [r.levelno for r in caplog.records] == [logging.WARNING]
    assert "g++ not found" in caplog.records[0].getMessage()
    ref = torch_paged_decode_attention(query, layer, pc.block_tables, pc.seq_lens, scale=0.1)
    assert torch.equal(out, ref)
    assert dispatch._fused_cpu(query, layer) is None
