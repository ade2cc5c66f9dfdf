"""Run a check script in a fresh interpreter with the CPU kernels capped at an ISA."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def run_capped(isa: str, script: str) -> None:
    """Run `script` with KVMESH_CPU_KERNEL_ISA=isa (this folder importable); it must exit 0
    and print exactly "ok"."""
    env = dict(os.environ, KVMESH_CPU_KERNEL_ISA=isa)
    here = str(Path(__file__).parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (here, env.get("PYTHONPATH", "")) if p)
    out = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["ok"]
