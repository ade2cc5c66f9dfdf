"""Folders built once in kvmesh's cache: locked, atomic, reused; the cached tiny test model."""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer

from kvmesh.engine.errors import InvalidParameterError
from kvmesh.models.cache import materialize, models_dir
from kvmesh.models.tiny import tiny_model_path
from kvmesh.models.tokenizer import EOS_TOKEN_ID

ROOT = Path(__file__).resolve().parents[2]
TINY_NAME = "tiny-llama-test-seed0-v1"


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("KVMESH_CACHE_DIR", str(tmp_path))
    return tmp_path / "models"


def test_tiny_model_is_built_once(cache: Path) -> None:
    first = tiny_model_path()
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    assert tiny_model_path() == first == cache / TINY_NAME
    assert (first / "model.safetensors").stat().st_mtime_ns == stamp
    assert AutoTokenizer.from_pretrained(first).eos_token_id == EOS_TOKEN_ID
    with pytest.raises(InvalidParameterError, match=r"^size:"):
        tiny_model_path("huge")


def test_concurrent_processes_build_once(tmp_path: Path) -> None:
    code = "from kvmesh.models import tiny_model_path; print(tiny_model_path())"
    env = {**os.environ, "KVMESH_CACHE_DIR": str(tmp_path)}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code], cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True
        )
        for _ in range(2)
    ]
    outs = [p.communicate(timeout=120)[0].strip() for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert outs[0] == outs[1] == str(tmp_path / "models" / TINY_NAME)
    leftovers = [p.name for p in (tmp_path / "models").iterdir() if not p.name.endswith(".lock")]
    assert leftovers == [TINY_NAME]
    AutoModelForCausalLM.from_pretrained(outs[0])


def test_failed_build_leaves_nothing_and_is_retried(cache: Path) -> None:
    def broken(staging: Path) -> None:
        (staging / "config.json").write_text("{}")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        materialize("m", broken)
    assert [p.name for p in models_dir().iterdir()] == [".m.lock"]
    built = materialize("m", lambda staging: (staging / "done").write_text("yes"))
    assert (built / "done").read_text() == "yes"


def test_wait_for_another_build_is_bounded(cache: Path) -> None:
    cache.mkdir()
    with open(cache / f".{TINY_NAME}.lock", "w") as held:
        fcntl.flock(held.fileno(), fcntl.LOCK_EX)  # another process is building
        with pytest.raises(TimeoutError, match="lock"):
            materialize(TINY_NAME, lambda staging: None, lock_timeout=0.2)
    assert not (cache / TINY_NAME).exists()


@pytest.mark.parametrize("name", ["..", ".", "", "a/..", "a//b", "/abs", "a/../b"])
def test_a_name_outside_its_own_folder_is_refused(cache: Path, name: str) -> None:
    with pytest.raises(ValueError, match=r"^name: .* is not a folder inside"):
        materialize(name, lambda staging: (staging / "done").write_text("yes"))
    assert not cache.exists()  # nothing made, not even the lock
    built = materialize("key/stem", lambda staging: (staging / "done").write_text("yes"))
    assert built == cache / "key" / "stem" and (built / "done").is_file()
