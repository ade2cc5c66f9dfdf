"""`kvmesh bench throughput`: the vLLM side's W1 generator matches kvmesh's; ratio report."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from kvmesh.cli import bench_throughput
from kvmesh.cli.bench_throughput import _report, w1_requests

VLLM_SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "vllm_w1.py"


def _load_vllm_script():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("vllm_w1", VLLM_SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_vllm_script_draws_the_same_w1_requests() -> None:
    assert bench_throughput.VLLM_SCRIPT == VLLM_SCRIPT
    theirs = _load_vllm_script().w1_requests(32000, 64)
    assert theirs == w1_requests(32000, 64)
    assert sum(len(p) for p, _ in theirs) == 17725
    assert sum(n for _, n in theirs) == 8885


def test_warmup_prompt_is_no_w1_prefix() -> None:
    prompt, _ = bench_throughput.WARMUP_PROMPT
    assert all(p[:16] != prompt[:16] for p, _ in w1_requests(32000, 64))


def _run(name: str, tok_per_s: float) -> dict:
    return {"name": name, "tokens": 100, "seconds": 1.0, "tok_per_s": tok_per_s}


def test_report_gives_median_and_range_over_repeats() -> None:
    repeats = [
        [_run("kvmesh", 300.0), _run("vllm", 150.0)],
        [_run("kvmesh", 240.0), _run("vllm", 160.0)],
        [_run("kvmesh", 330.0), _run("vllm", 150.0)],
    ]
    report = _report("W1", repeats)
    key = "tok_per_s kvmesh / vllm"
    assert report["ratios"][key] == 2.0
    assert report["ratio_range"][key] == [1.5, 2.2]
    assert len(report["repeats"]) == 3
    single = _report("W1", repeats[:1])
    assert single["ratios"][key] == 2.0 and "ratio_range" not in single
