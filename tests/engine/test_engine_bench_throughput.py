"""`kvmesh bench throughput`: the vLLM side's W1 generator matches kvmesh's; ratio report."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from kvmesh.cli import bench_throughput
from kvmesh.cli.bench_throughput import _report, w1_requests, w3_requests

VLLM_SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "vllm_bench.py"


def _load_vllm_script():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("vllm_bench", VLLM_SCRIPT)
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


def test_vllm_script_draws_the_same_w3_requests() -> None:
    script = _load_vllm_script()
    for shared in (True, False):
        assert script.w3_requests(32000, shared, 64) == w3_requests(32000, shared, 64)
    shared_heads = {tuple(p[:500]) for p, _ in w3_requests(32000, True, 64)}
    assert len(shared_heads) == 1


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


def test_w3_report_compares_cached_ttft_with_vllms() -> None:
    def run(name: str, ttft_mean: float) -> dict:
        return {**_run(name, 100.0), "ttft_mean": ttft_mean}

    results = [
        run("prefix-cache-on", 0.03),
        run("prefix-cache-off", 0.15),
        run("vllm-prefix-cache-on", 0.12),
        run("vllm-prefix-cache-off", 0.30),
    ]
    ratios = _report("W3", [results])["ratios"]
    assert ratios["ttft_mean on / off"] == 0.2
    assert ratios["ttft_mean prefix-cache-on / vllm-prefix-cache-on"] == 0.25
    assert ratios["ttft_mean prefix-cache-off / vllm-prefix-cache-off"] == 0.5
