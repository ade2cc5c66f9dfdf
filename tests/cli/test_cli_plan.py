"""`kvmesh plan` end to end: JSON fields, table, weights from a model folder, bad configs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from kvmesh.cli.main import main

LLAMA_70B = {
    "model_type": "llama",
    "num_hidden_layers": 80,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "hidden_size": 8192,
    "torch_dtype": "float16",
    "max_position_embeddings": 4096,
}


@pytest.fixture
def model_folder(tmp_path: Path) -> Path:
    (tmp_path / "config.json").write_text(json.dumps(LLAMA_70B))
    save_file({"w": np.zeros((1024, 1024), np.float16)}, str(tmp_path / "model.safetensors"))
    return tmp_path


def test_json_plan_for_a_model_folder(model_folder: Path, capsys: pytest.CaptureFixture) -> None:
    argv = ["plan", str(model_folder), "--gpu-memory", "40GiB", "--max-model-len", "2048", "--json"]
    assert main(argv) == 0
    plan = json.loads(capsys.readouterr().out)
    weights = 1024 * 1024 * 2
    budget = int(40 * 1024**3 * 0.9) - weights
    assert plan["kv_bytes_per_token"] == 320 * 1024
    assert plan["weights_bytes"] == weights
    assert plan["kv_budget_bytes"] == budget
    assert plan["num_blocks"] == budget // (16 * 320 * 1024)
    assert plan["token_capacity"] == plan["num_blocks"] * 16
    assert plan["max_concurrency"] == plan["num_blocks"] // (2048 // 16)
    assert plan["contiguous_max_concurrency"] == budget // (2048 * 320 * 1024)
    assert plan["model_type"] == "llama"


def test_options_change_the_plan(model_folder: Path, capsys: pytest.CaptureFixture) -> None:
    config = str(model_folder / "config.json")
    argv = [config, "--kv-dtype", "int8", "--block-size", "32", "--utilization", "0.5", "--json"]
    assert main(["plan", *argv]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert (plan["kv_dtype"], plan["block_size"], plan["utilization"]) == ("int8", 32, 0.5)
    assert plan["kv_bytes_per_token"] == 160 * 1024 + 2 * 80 * 8 * 4
    assert plan["max_model_len"] == 4096


def test_table_shows_bytes_per_token(model_folder: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "kvmesh.cli.main", "plan", str(model_folder)],
        capture_output=True,
        text=True,
        check=True,
    )
    assert "KV bytes per token" in result.stdout
    assert "320 KiB" in result.stdout


@pytest.mark.parametrize(
    ("config", "extra", "field"),
    [
        ({**LLAMA_70B, "num_hidden_layers": None}, [], "num_hidden_layers"),
        ({**LLAMA_70B, "num_key_value_heads": 7}, [], "num_key_value_heads"),
        (LLAMA_70B, ["--gpu-memory", "1MiB"], "weights_bytes"),
        (LLAMA_70B, ["--gpu-memory", "eighty"], "gpu_memory"),
        (LLAMA_70B, ["--kv-dtype", "int4"], "kv_dtype"),
    ],
)
def test_bad_input_exits_2_with_one_line_naming_the_field(
    tmp_path: Path, config: dict, extra: list[str], field: str
) -> None:
    (tmp_path / "config.json").write_text(json.dumps(config))
    if field == "weights_bytes":
        save_file({"w": np.zeros(2**20, np.int8)}, str(tmp_path / "model.safetensors"))
    result = subprocess.run(
        [sys.executable, "-m", "kvmesh.cli.main", "plan", str(tmp_path), *extra],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 2
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1
    assert lines[0].startswith(f"kvmesh plan: {field}:")
