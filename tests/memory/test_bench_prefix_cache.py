"""`kvmesh bench prefix-cache`: the admission policy keeps a hot prefix under pollution."""

from __future__ import annotations

import json

import pytest

from kvmesh.cli.bench_prefix_cache import Workload, make_stream, replay
from kvmesh.cli.main import main

SMALL = Workload(
    requests=300,
    hot_fraction=0.25,
    hot_tokens=128,
    unique_min=128,
    unique_max=384,
    output_tokens=8,
    cache_blocks=64,
    block_size=16,
    concurrency=2,
    seed=0,
)


def test_slru_keeps_the_hot_prefix_where_lru_loses_it() -> None:
    stream = make_stream(SMALL)
    unique_tokens = sum(len(prompt) for hot, prompt in stream if not hot)
    assert unique_tokens > 50 * SMALL.cache_blocks * SMALL.block_size
    slru, lru = replay(SMALL, stream, "slru"), replay(SMALL, stream, "lru")
    assert slru["hot_requests"] == lru["hot_requests"] > 50
    assert slru["hot_hit_rate"] >= 0.95
    assert lru["hot_hit_rate"] < 0.8


def test_cli_json_reports_both_policies(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["bench", "prefix-cache", "--json", "--requests", "40", "--cache-blocks", "128"]
    assert main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    assert set(report["policies"]) == {"slru", "lru"}
    assert report["workload"]["requests"] == 40


def test_cli_rejects_bad_input_naming_the_flag(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "prefix-cache", "--cache-blocks", "4"]) == 2
    assert "--cache-blocks" in capsys.readouterr().err
