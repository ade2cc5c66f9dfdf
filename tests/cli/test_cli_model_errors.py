"""A `--model` that names nothing loadable ends `generate`, `serve ROLE` and `up` with one line
on stderr saying what was tried, exit status 2, and no traceback."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

KVMESH = [sys.executable, "-m", "kvmesh.cli.main"]
ROOT = Path(__file__).resolve().parents[2]
HUB_ID = "Qwen/Qwen2.5-0.5B"


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[int, str, str]]:
    """Every command run once, all at the same time: {name: (exit code, argv text, stderr)}."""
    from transformers import GPT2Config

    base = tmp_path_factory.mktemp("model-errors")
    gpt2 = base / "gpt2"
    GPT2Config(n_layer=1, n_embd=32, n_head=2).save_pretrained(gpt2)
    env = {**os.environ, "HF_HOME": str(base / "hf"), "KVMESH_CACHE_DIR": str(base / "cache")}
    env.pop("HF_HUB_CACHE", None)
    env.pop("HUGGINGFACE_HUB_CACHE", None)
    commands = {
        "generate": ["generate", "hello", "--model", HUB_ID],
        "generate-unsupported": ["generate", "hello", "--model", str(gpt2)],
        "prefill": ["serve", "prefill", "--insecure-no-auth", "--model", HUB_ID],
        "decode": [
            "serve",
            "decode",
            "--insecure-no-auth",
            "--model",
            str(base / "no-such-folder"),
        ],
        "colocated": ["serve", "colocated", "--insecure-no-auth", "--model", str(gpt2)],
        "up": ["up", "--model", HUB_ID, "--port", "0"],
    }
    procs = {
        name: subprocess.Popen(
            [*KVMESH, *argv],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for name, argv in commands.items()
    }
    out = {}
    for name, proc in procs.items():
        _, stderr = proc.communicate(timeout=180)
        out[name] = (proc.returncode, " ".join(commands[name]), stderr)
    return out


@pytest.mark.parametrize(
    ("name", "prefix", "says"),
    [
        ("generate", "kvmesh generate: model: ", "no snapshot in the Hugging Face cache"),
        ("prefill", "kvmesh serve prefill: model: ", "no snapshot in the Hugging Face cache"),
        ("up", "kvmesh up: model: ", "no snapshot in the Hugging Face cache"),
        ("decode", "kvmesh serve decode: model: ", "no such folder or .gguf file"),
        ("generate-unsupported", "kvmesh generate: model: ", "'gpt2' is not supported"),
        ("colocated", "kvmesh serve colocated: model: ", "'gpt2' is not supported"),
    ],
)
def test_one_line_and_exit_2(
    results: dict[str, tuple[int, str, str]], name: str, prefix: str, says: str
) -> None:
    code, argv, stderr = results[name]
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert code == 2, (argv, stderr)
    assert "Traceback" not in stderr, stderr
    assert len(lines) == 1 and lines[0].startswith(prefix), stderr
    assert says in lines[0]
    if "Hugging Face" in says:
        assert HUB_ID in lines[0] and "hf download" in lines[0] and "hub" in lines[0]
