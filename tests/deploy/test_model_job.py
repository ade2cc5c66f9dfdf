"""The model Job's script and the workers' wait step, run for real on a tiny GGUF file.

The Job (deploy/k8s/base/model.yaml, the same script in the Helm chart) fetches `url` once and
converts it once with `kvmesh model convert`; the workers' init container waits for the folder
and checks it with `kvmesh model path`. Here the fetch reads a file:// URL.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import yaml

from tests.models.gguf_fixture import write_tiny_gguf

ROOT = Path(__file__).resolve().parents[2]
BASE = ROOT / "deploy" / "k8s" / "base"
TIMEOUT_S = 120


def manifest(name: str, kind: str) -> dict:
    for doc in yaml.safe_load_all((BASE / name).read_text()):
        if doc and doc["kind"] == kind:
            return dict(doc)
    raise AssertionError(f"{name} has no {kind}")


def run_sh(script: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"
    return subprocess.run(
        ["sh", "-c", script],
        env={**os.environ, "PATH": path, **env},
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )


def test_the_job_fetches_and_converts_once_and_workers_find_it(tmp_path: Path) -> None:
    config = manifest("model.yaml", "ConfigMap")["data"]
    source = tmp_path / "published" / "tiny.gguf"
    source.parent.mkdir()
    write_tiny_gguf(source)
    models = tmp_path / "models"
    env = {"MODELS_DIR": str(models), "MODEL_NAME": "tiny", "MODEL_URL": source.as_uri(),
           "KVMESH_CACHE_DIR": str(tmp_path / "cache")}  # fmt: skip

    first = run_sh(config["prepare.sh"], env)
    assert first.returncode == 0, first.stderr
    checkpoint = models / "checkpoints" / "tiny"
    assert (checkpoint / "config.json").is_file()
    assert (models / "incoming" / "tiny.gguf").read_bytes() == source.read_bytes()
    stamp = (checkpoint / "config.json").stat().st_mtime_ns

    again = run_sh(config["prepare.sh"], {**env, "MODEL_URL": "file:///nonexistent.gguf"})
    assert again.returncode == 0 and "is ready" in again.stdout, again.stderr
    assert (checkpoint / "config.json").stat().st_mtime_ns == stamp, "converted twice"

    pod = manifest("decode.yaml", "Deployment")["spec"]["template"]["spec"]
    (wait,) = pod["initContainers"]
    waited = run_sh(wait["command"][2], {"KVMESH_MODEL": str(checkpoint)})
    assert waited.returncode == 0, waited.stderr
    assert waited.stdout.strip() == str(checkpoint)


def test_a_failed_fetch_leaves_no_model(tmp_path: Path) -> None:
    config = manifest("model.yaml", "ConfigMap")["data"]
    models = tmp_path / "models"
    env = {"MODELS_DIR": str(models), "MODEL_NAME": "m",
           "MODEL_URL": (tmp_path / "missing.gguf").as_uri()}  # fmt: skip
    done = run_sh(config["prepare.sh"], env)
    assert done.returncode != 0
    assert not (models / "checkpoints" / "m").exists()
    assert not (models / "incoming" / "m.gguf").exists()


def test_without_a_url_the_job_converts_the_image_default_gguf(tmp_path: Path) -> None:
    # The whole default conversion takes minutes; the script's source line is run on its own.
    script = manifest("model.yaml", "ConfigMap")["data"]["prepare.sh"]
    (line,) = re.findall(r"python -c '(from kvmesh\.models\.default [^']*)'", script)
    done = run_sh(f"python -c '{line}'", {})
    assert done.returncode == 0, done.stderr
    default = Path(done.stdout.strip())
    assert default.suffix == ".gguf" and default.is_file()
