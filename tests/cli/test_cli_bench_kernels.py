"""`kvmesh bench kernels` runs end to end in each dtype (tiny shapes, a real process)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

SMALL = ["--batch", "2", "--contexts", "40", "--q-heads", "4", "--kv-heads", "2"]
SMALL += ["--head-dim", "32", "--repeats", "1", "--write-tokens", "64", "--json"]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_bench_kernels_reports_the_dtype_it_ran(dtype: str) -> None:
    command = [sys.executable, "-m", "kvmesh.cli.main", "bench", "kernels", *SMALL]
    out = subprocess.run([*command, "--dtype", dtype], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["shape"]["dtype"] == dtype
    assert [row["context"] for row in result["decode"]] == [40]
    assert result["decode"][0]["contiguous_ms"] > 0
    assert [row["kv_dtype"] for row in result["write_kv"]] == ["auto", "int8", "fp8"]


def test_bench_kernels_refuses_an_unknown_dtype() -> None:
    command = [sys.executable, "-m", "kvmesh.cli.main", "bench", "kernels", "--dtype", "int4"]
    out = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "--dtype" in out.stderr
