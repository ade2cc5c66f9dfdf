"""An engine option that only the loaded model or the host can refuse (`--max-model-len` beyond
the model's positions, a KV budget without one block or without room for one sequence of
max_model_len, which would refuse every request up to the context later, a KV pool or host
tier larger than the host's memory, a step budget below max_model_len without chunked prefill)
ends `kvmesh serve ROLE` before it serves: exit 2, one line on stderr naming the flag, no
traceback, never an out-of-memory kill or a bare errno later."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from kvmesh.models.tiny import tiny_model_path

KVMESH = [sys.executable, "-m", "kvmesh.cli.main"]
ROOT = Path(__file__).resolve().parents[2]


def twice_the_memory_gib() -> int:
    with open("/proc/meminfo") as meminfo:
        for line in meminfo:
            if line.startswith("MemTotal:"):
                return 2 * int(line.split()[1]) // (1 << 20) + 2
    raise AssertionError("no MemTotal")


CASES = {  # name: (role, flags, what the line says after "kvmesh serve ROLE: ")
    "positions": ("colocated", ["--max-model-len", "4096"], "--max-model-len: 4096 exceeds"),
    "no-block": ("prefill", ["--kv-cache-memory", "1KiB"], "--kv-cache-memory: budget holds"),
    "one-sequence": (
        "decode",
        ["--kv-cache-memory", "100KiB"],
        "--kv-cache-memory: the KV budget holds 6 blocks (96 tokens), fewer than the 128",
    ),
    "step-budget": (
        "decode",
        ["--max-num-batched-tokens", "100", "--no-enable-chunked-prefill"],
        "--max-num-batched-tokens: must be >= max_model_len",
    ),
    "pool-ram": ("colocated", ["--kv-cache-memory", "{ram}GiB"], "--kv-cache-memory: the KV"),
    "blocks-ram": ("prefill", ["--num-kv-blocks", "400000000"], "--num-kv-blocks: the KV cache"),
    "tier-ram": (
        "colocated",
        ["--num-kv-blocks", "64", "--host-kv-gib", "{ram}"],
        "--host-kv-gib: the host KV tier",
    ),
}


@pytest.fixture(scope="module")
def results() -> dict[str, tuple[int, str]]:
    """Every case run once, all at the same time: {name: (exit code, stderr)}."""
    if not Path("/proc/meminfo").exists():
        pytest.skip("needs /proc/meminfo")
    ram = str(twice_the_memory_gib())
    procs = {}
    for name, (role, flags, _) in CASES.items():
        argv = [*KVMESH, "serve", role, "--insecure-no-auth", "--model", str(tiny_model_path()),
                "--log-level", "WARNING", *(f.replace("{ram}", ram) for f in flags)]  # fmt: skip
        procs[name] = subprocess.Popen(
            argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
    out = {}
    for name, proc in procs.items():
        try:
            _, stderr = proc.communicate(timeout=180)
        except subprocess.TimeoutExpired:
            proc.kill()
            _, stderr = proc.communicate()
        out[name] = (proc.returncode, stderr)
    return out


@pytest.mark.parametrize("name", list(CASES))
def test_one_line_naming_the_flag_and_exit_2(
    results: dict[str, tuple[int, str]], name: str
) -> None:
    role, _, says = CASES[name]
    code, stderr = results[name]
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert code == 2, stderr
    assert "Traceback" not in stderr, stderr
    assert len(lines) == 1, stderr
    assert lines[0].startswith(f"kvmesh serve {role}: {says}"), stderr
