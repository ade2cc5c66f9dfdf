"""A malformed comma-separated flag (`kvmesh generate --stop-token-ids`, `--prompt-ids` with
`--target`, `kvmesh bench serve --rates`) exits 2 naming the flag, before anything starts."""

from __future__ import annotations

import subprocess
import sys

import pytest

KVMESH = [sys.executable, "-m", "kvmesh.cli.main"]
CASES = {
    "offline-stop-ids": (["generate", "--prompt-ids", "1,2", "--stop-token-ids", "5,x"],
                         "--stop-token-ids"),
    "remote-stop-ids": (["generate", "--target", "127.0.0.1:1", "--stop-token-ids", "x", "hi"],
                        "--stop-token-ids"),
    "remote-prompt-ids": (["generate", "--target", "127.0.0.1:1", "--prompt-ids", "1,x"],
                          "--prompt-ids"),
    "rates-not-numbers": (["bench", "serve", "--rates", "1,abc"], "--rates"),
    "rates-not-positive": (["bench", "serve", "--rates", "1,-2"], "--rates"),
}  # fmt: skip


@pytest.fixture(scope="module")
def results() -> dict[str, subprocess.CompletedProcess[str]]:
    """Every command run once, all at the same time."""
    procs = {
        name: subprocess.Popen(
            [*KVMESH, *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for name, (argv, _) in CASES.items()
    }
    done = {}
    for name, proc in procs.items():
        out, err = proc.communicate(timeout=120)
        done[name] = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    return done


@pytest.mark.parametrize("name", sorted(CASES))
def test_exit_2_naming_the_flag(
    results: dict[str, subprocess.CompletedProcess[str]], name: str
) -> None:
    result, flag = results[name], CASES[name][1]
    assert result.returncode == 2, result.stderr
    assert flag in result.stderr and "Traceback" not in result.stderr
