"""`kvmesh bench scheduler` runs end to end on a small batch and reports what it promises."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvmesh.cli.bench_scheduler import measure
from kvmesh.cli.main import main


def test_measure_reports_per_step_statistics() -> None:
    row = measure(8, steps=20)
    assert row["running"] == 8 and row["steps"] == 20
    assert 0 < row["p50_us"] <= row["p99_us"]
    assert row["cpu_mean_us"] > 0
    assert 0 < row["cpu_p50_us"] <= row["cpu_p99_us"]


def test_cli_json_output(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "scheduler", "--batch", "4", "--steps", "5", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["goal_us"] == 500.0
    assert [row["running"] for row in report["results"]] == [4]


def test_side_by_side_against_another_tree() -> None:
    script = Path(__file__).resolve().parents[2] / "bench" / "scheduler_step.py"
    repo = script.parents[1]
    args = ["--against", str(repo), "--rounds", "1", "--batch", "4", "--steps", "5", "--json"]
    done = subprocess.run(
        [sys.executable, str(script), *args], cwd=repo, capture_output=True, text=True, check=True
    )
    report = json.loads(done.stdout)
    assert [(row["code"], row["running"]) for row in report["results"]] == [
        ("this", 4),
        ("against", 4),
    ]
    assert all(row["cpu_mean_us"] > 0 for row in report["results"])
