"""Building a worker's argument parser imports neither torch nor the engine."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

CODE = """
import sys
import decode_svc.colocated, decode_svc.main, prefill_svc.main
import kvmesh.engine.async_engine, kvmesh.service.status
from kvmesh.service.options import parser
for role in ("prefill", "decode", "colocated"):
    parser(role, transfer=role != "colocated").parse_args(["--port", "1"])
heavy = sorted(m for m in ("torch", "transformers", "kvmesh.engine.engine") if m in sys.modules)
print(",".join(heavy))
"""


def test_role_modules_and_options_do_not_import_torch() -> None:
    result = subprocess.run(
        [sys.executable, "-c", CODE],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={"PYTHONPATH": f"{ROOT}:{ROOT / 'kernels'}", "PATH": ""},
        timeout=60,
        check=True,
    )
    assert result.stdout.strip() == "", f"imported: {result.stdout.strip()}"
