"""The committed gRPC code in kvmesh/v1 imports under every grpcio and protobuf that
pyproject.toml admits, and the pinned generator is the one that wrote it.

Generated code refuses to import under a runtime older than its generator: a floor below the
generated version lets pip install a kvmesh that fails at its first import.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

from packaging.requirements import Requirement
from packaging.version import Version

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent
GENERATED = ROOT / "kvmesh" / "v1"


def requirements(group: str | None = None) -> dict[str, Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    lines = project["dependencies"] if group is None else project["optional-dependencies"][group]
    return {req.name: req for req in map(Requirement, lines)}


def floor(req: Requirement) -> Version:
    floors = [Version(s.version) for s in req.specifier if s.operator in (">=", "==")]
    assert floors, f"{req.name} has no lower bound in pyproject.toml"
    return max(floors)


def generated_versions(glob: str, pattern: str) -> set[Version]:
    """The generator versions named in the generated modules matching `glob`: `pattern`'s
    groups joined by dots, one per module (a module without it fails the test)."""
    versions = set()
    for path in sorted(GENERATED.glob(glob)):
        match = re.search(pattern, path.read_text(), re.MULTILINE)
        assert match, f"{path.name}: no generator version found"
        versions.add(Version(".".join(match.groups())))
    return versions


def grpc_generated_versions() -> set[Version]:
    return generated_versions("*_pb2_grpc.py", r"^GRPC_GENERATED_VERSION = '([^']+)'$")


def protobuf_gencode_versions() -> set[Version]:
    return generated_versions(
        "*_pb2.py",
        r"ValidateProtobufRuntimeVersion\(\s*_runtime_version\.Domain\.PUBLIC,"
        r"\s*(\d+),\s*(\d+),\s*(\d+),",
    )


def test_generated_modules_share_one_generator() -> None:
    assert len(grpc_generated_versions()) == 1, "the gRPC modules come from different generators"
    assert len(protobuf_gencode_versions()) == 1


def test_grpcio_floor_admits_no_runtime_older_than_the_generated_code() -> None:
    (generated,) = grpc_generated_versions()
    assert floor(requirements()["grpcio"]) >= generated, (
        f"grpcio's floor is below {generated}, the version kvmesh/v1 was generated for"
    )


def test_protobuf_floor_admits_no_runtime_older_than_the_gencode() -> None:
    (gencode,) = protobuf_gencode_versions()
    assert floor(requirements()["protobuf"]) >= gencode


def test_the_pinned_generator_wrote_the_committed_code() -> None:
    tools = requirements("dev")["grpcio-tools"]
    pins = [s.version for s in tools.specifier if s.operator == "=="]
    assert pins, "grpcio-tools must be pinned: its version is written into the generated code"
    assert grpc_generated_versions() == {Version(pins[0])}
