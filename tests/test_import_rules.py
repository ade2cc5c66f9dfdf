"""The layering rules of docs/ARCHITECTURE.md, checked on the source and by importing in fresh
processes."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = {
    "kvmesh": ROOT / "kvmesh",
    "kvmesh_kernels": ROOT / "kernels" / "kvmesh_kernels",
    "kv_transfer": ROOT / "kv_transfer",
    "prefill_svc": ROOT / "prefill_svc",
    "decode_svc": ROOT / "decode_svc",
    "control_plane": ROOT / "control_plane",
}
# package -> top-level names it must never import
FORBIDDEN = {
    "kvmesh_kernels": {"kvmesh", "kv_transfer", "prefill_svc", "decode_svc", "control_plane"},
    "kv_transfer": {"prefill_svc", "decode_svc", "control_plane"},
    "prefill_svc": {"decode_svc", "control_plane"},
    "decode_svc": {"prefill_svc", "control_plane"},
    "control_plane": {
        "torch",
        "kvmesh_kernels",
        "kv_transfer",
        "prefill_svc",
        "decode_svc",
        "transformers",
        "triton",
    },
}
ENGINE_FORBIDDEN = {"grpc", "kvmesh.v1"}


def imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def files_of(package: str) -> list[Path]:
    return sorted(PACKAGES[package].rglob("*.py"))


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_packages_respect_layering(package: str) -> None:
    bad = []
    for path in files_of(package):
        for name in imported_modules(path):
            top = name.split(".")[0]
            if top in FORBIDDEN[package]:
                bad.append(f"{path.relative_to(ROOT)} imports {name}")
    assert not bad, "\n".join(bad)


# stubs; grpc-only auth and TLS; OpenTelemetry-only tracing and logging setup; the
# prometheus_client-only metrics port
CONTROL_PLANE_KVMESH = (
    "kvmesh.v1",
    "kvmesh.security",
    "kvmesh.telemetry.tracing",
    "kvmesh.telemetry.logs",
    "kvmesh.telemetry.metrics_http",
)


def test_control_plane_imports_only_generated_stubs_and_security_from_kvmesh() -> None:
    bad = []
    for path in files_of("control_plane"):
        for name in imported_modules(path):
            if name.split(".")[0] == "kvmesh" and not name.startswith(CONTROL_PLANE_KVMESH):
                bad.append(f"{path.relative_to(ROOT)} imports {name}")
    assert not bad, "\n".join(bad)


def test_engine_never_imports_grpc_or_protobuf() -> None:
    engine = ROOT / "kvmesh" / "engine"
    bad = []
    for path in sorted(engine.rglob("*.py")) if engine.exists() else []:
        for name in imported_modules(path):
            if any(name == f or name.startswith(f + ".") for f in ENGINE_FORBIDDEN):
                bad.append(f"{path.relative_to(ROOT)} imports {name}")
    assert not bad, "\n".join(bad)


def test_source_roots_are_not_importable_packages() -> None:
    assert not (ROOT / "kernels" / "__init__.py").exists()
    assert not (ROOT / "protos" / "__init__.py").exists()


LIGHT_IMPORTS = [
    "kvmesh",
    "kvmesh.client",
    "kvmesh.cli.main",
    "control_plane",
    "kv_transfer",
    "kvmesh.memory",
    "kvmesh.security",
]


@pytest.mark.parametrize("module", LIGHT_IMPORTS)
def test_light_imports_do_not_pull_torch(module: str) -> None:
    code = (
        f"import sys, importlib; importlib.import_module({module!r}); "
        "heavy = sorted(m for m in ('torch', 'transformers', 'triton') if m in sys.modules); "
        "print(','.join(heavy))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT
    )
    assert out.stdout.strip() == "", f"{module} pulled in {out.stdout.strip()}"
