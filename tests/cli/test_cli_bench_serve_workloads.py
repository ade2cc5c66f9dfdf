"""The serving benchmark's workloads, traces, arrival schedules and percentiles (no server)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from kvmesh.cli.bench_throughput import w1_requests, w3_requests
from kvmesh.loadgen import workloads
from kvmesh.loadgen.metrics import distribution, percentile
from kvmesh.loadgen.runner import Arrival
from kvmesh.loadgen.tuner import grid, parse_chunks


def test_w1_and_w3_are_the_engine_benchmarks_requests() -> None:
    ours = workloads.build("w1", 32000, 64)
    assert [(r.prompt, r.output_len) for r in ours] == w1_requests(32000, 64)
    shared = workloads.build("w3", 32000, 8)
    assert [(r.prompt, r.output_len) for r in shared] == w3_requests(32000, True, 8)
    assert all(r.prompt_len == len(r.prompt) and r.at is None for r in ours)


def test_w4_has_its_own_schedule_and_scales_lengths() -> None:
    shape = workloads.W4Shape(steady=3, long=2, interval=1.5)
    requests = workloads.build("w4", 1000, shape=shape, scale=0.5)
    steady, long = requests[:3], requests[3:]
    assert [(r.group, r.prompt_len, r.output_len, r.at) for r in steady] == [
        ("steady", 64, 256, 0.0)
    ] * 3
    assert [(r.group, r.prompt_len, r.output_len, r.at) for r in long] == [
        ("long", 1024, 8, 0.0),
        ("long", 1024, 8, 1.5),
    ]
    # The schedule wins over a rate; ignore_schedule hands it back to the arrival process.
    assert Arrival(rate=100.0).offsets(requests) == [0.0, 0.0, 0.0, 0.0, 1.5]
    assert Arrival(rate=1.0, process="fixed", ignore_schedule=True).offsets(requests) == [
        0.0, 1.0, 2.0, 3.0, 4.0,
    ]  # fmt: skip


def test_poisson_arrivals_are_seeded_with_the_right_mean_gap() -> None:
    requests = workloads.build("w1", 1000, 400, scale=0.01)
    offsets = Arrival(rate=4.0, seed=3).offsets(requests)
    assert offsets == Arrival(rate=4.0, seed=3).offsets(requests)
    assert offsets != Arrival(rate=4.0, seed=4).offsets(requests)
    assert offsets == sorted(offsets) and offsets[0] == 0.0
    assert offsets[-1] / (len(offsets) - 1) == pytest.approx(0.25, rel=0.15)
    assert set(Arrival().offsets(requests)) == {0.0}  # rate inf: all at once


def test_trace_lines_become_requests_and_bad_lines_are_named(tmp_path: Path) -> None:
    trace = tmp_path / "t.jsonl"
    lines = [
        {"prompt": "hello", "output_len": 3, "at": 0.5},
        {"prompt": [5, 6, 7], "max_tokens": 2},
        {"prompt_len": 10, "output_len": 1},
    ]
    trace.write_text("\n".join(json.dumps(x) for x in lines) + "\n\n")
    got = workloads.build("trace", 100, trace=str(trace))
    assert [(r.prompt, r.output_len, r.at) for r in got[:2]] == [
        ("hello", 3, 0.5),
        ([5, 6, 7], 2, None),
    ]
    assert got[2].prompt_len == len(got[2].prompt) == 10
    assert len(workloads.build("trace", 100, 2, trace=str(trace))) == 2
    trace.write_text(json.dumps({"prompt": "x", "output_len": 0}) + "\n")
    with pytest.raises(workloads.WorkloadError, match="line 1: output_len"):
        workloads.build("trace", 100, trace=str(trace))
    with pytest.raises(workloads.WorkloadError, match="--trace"):
        workloads.build("trace", 100)
    with pytest.raises(workloads.WorkloadError, match="--scale"):
        workloads.build("w1", 100, scale=0)


def test_percentiles_interpolate_and_stay_ordered() -> None:
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile([7.0], 99) == 7.0
    d = distribution([0.001 * i for i in range(1, 101)])
    assert d is not None and d["p50"] == pytest.approx(50.5) and d["p99"] == pytest.approx(99.01)
    assert d["p50"] <= d["p90"] <= d["p99"] and distribution([]) is None


def test_tuner_grid_skips_redundant_chunk_caps_and_checks_values() -> None:
    settings = grid([128, 512], parse_chunks("none,256"), ["decode-first", "prefill-first"])
    assert [s.name for s in settings] == ["128/-/df", "512/-/df", "512/256/df", "128/-/pf",
                                          "512/-/pf", "512/256/pf"]  # fmt: skip
    assert settings[2].flags() == ["--max-num-batched-tokens", "512",
                                   "--long-prefill-token-threshold", "256",
                                   "--scheduling-policy", "decode-first"]  # fmt: skip
    with pytest.raises(ValueError, match="--policies"):
        grid([128], [None], ["fastest"])
    with pytest.raises(ValueError, match="positive"):
        grid([0], [None], ["decode-first"])
    assert math.isinf(Arrival().rate)
