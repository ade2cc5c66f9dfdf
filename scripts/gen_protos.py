"""Generate Python code for protos/kvmesh/v1/*.proto into kvmesh/v1/.

`--check` regenerates into a temporary folder and fails when the committed code differs.
"""

from __future__ import annotations

import argparse
import filecmp
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "protos"
PACKAGE = Path("kvmesh") / "v1"


def generate(out_root: Path) -> list[Path]:
    from grpc_tools import protoc  # dev dependency

    sources = sorted((PROTO_ROOT / PACKAGE).glob("*.proto"))
    if not sources:
        return []
    include = Path(protoc.__file__).parent / "_proto"
    args = [
        "protoc",
        f"-I{PROTO_ROOT}",
        f"-I{include}",
        f"--python_out={out_root}",
        f"--pyi_out={out_root}",
        f"--grpc_python_out={out_root}",
        *[str(s.relative_to(PROTO_ROOT)) for s in sources],
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    return sorted((out_root / PACKAGE).glob("*_pb2*"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--check", action="store_true", help="fail if generated code is stale")
    args = parser.parse_args()
    if not args.check:
        for path in generate(ROOT):
            print(f"wrote {path.relative_to(ROOT)}")
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        fresh = generate(Path(tmp))
        committed = sorted((ROOT / PACKAGE).glob("*_pb2*"))
        names = {p.name for p in fresh}
        stale = [p.name for p in committed if p.name not in names]
        for path in fresh:
            target = ROOT / PACKAGE / path.name
            if not target.exists() or not filecmp.cmp(path, target, shallow=False):
                stale.append(path.name)
        if stale:
            print(f"generated protobuf code is stale: {stale}; run `make protos`", file=sys.stderr)
            return 1
        shutil.rmtree(tmp, ignore_errors=True)
    print("generated protobuf code is fresh")
    return 0


if __name__ == "__main__":
    sys.exit(main())
