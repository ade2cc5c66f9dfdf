"""`kvmesh kernels build`: compile (once per cache key) and load the fused CPU kernels now.

`scripts/install.sh` runs it after installing, so the first worker start does not compile. It
prints where the library is and exits 1 when it cannot be built: CPU workers then serve with
the slower torch reference. With `KVMESH_CPU_KERNEL=0` there is nothing to build (exit 0).
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any


def register(subparsers: Any) -> None:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "kernels", help="build the CPU kernels now (install does this; workers need them)"
    )
    inner = parser.add_subparsers(dest="kernels_command", metavar="ACTION", required=True)
    build = inner.add_parser("build", help="compile and load the fused CPU kernel library")
    build.set_defaults(func=run_build)


def run_build(args: argparse.Namespace) -> int:
    from kvmesh_kernels import cpu_build

    if not cpu_build.enabled():
        print(f"kvmesh kernels: disabled by {cpu_build.ENV_DISABLE}=0; nothing to build")
        return 0
    target = cpu_build.published_path()
    verb = "loading" if target.is_file() else "building (about a minute at most)"
    print(f"kvmesh kernels: {verb} the fused CPU kernels in {target.parent} ...", flush=True)
    started = time.monotonic()
    try:
        cpu_build.load()
    except Exception as exc:  # compiler missing, build error, load error
        detail = "\n".join(str(exc).strip().splitlines()[-3:]) or type(exc).__name__
        print(f"kvmesh kernels: build failed: {detail}\n"
              "CPU workers need a C++ compiler (g++) for their fast kernels; without it they "
              "serve with the torch reference.", file=sys.stderr)  # fmt: skip
        return 1
    print(f"kvmesh kernels: ready ({time.monotonic() - started:.1f} s): {target}", flush=True)
    return 0
