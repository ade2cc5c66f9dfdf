"""`kvmesh bench w4`: the W4 mix against a live disaggregated system, shrunk to a few tokens."""

from __future__ import annotations

import argparse
import asyncio
from typing import Any

from kvmesh.cli.bench_disagg import w4_configs, w4_once
from kvmesh.cli.up import LocalSystem


def test_w4_once_caps_long_prompts_and_counts_every_gap(
    shm_system: tuple[LocalSystem, Any],
) -> None:
    system, _ = shm_system
    sizes = {"steady": 3, "steady_prompt": 8, "steady_output": 6, "long_prompt": 40,
             "long_output": 2, "interval": 0.01, "max_long": 2}  # fmt: skip
    result = asyncio.run(w4_once(system.endpoint, sizes, "disaggregated"))
    assert result.long_prompts == 2  # capped although the decoders outlive many intervals
    # One gap per pair of streamed chunks; at least one token per chunk.
    assert 0 < len(result.itl_samples) <= 3 * (6 - 1)
    assert 0 < result.itl_p50_ms <= result.itl_p99_ms
    assert result.long_ttft_mean_ms <= result.long_ttft_max_ms


def test_w4_configs_cover_every_mode_and_chunk_size() -> None:
    args = argparse.Namespace(model="MODEL", threads=1, transfer_backend="shm",
                              modes="colocated,chunked,disaggregated", chunks="64,128")  # fmt: skip
    configs = w4_configs(args, long_prompt=512)
    labels = [label for label, _ in configs]
    assert labels == ["colocated, no chunking", "colocated, chunk 64", "colocated, chunk 128",
                      "disaggregated 1P+1D"]  # fmt: skip
    whole = configs[0][1]
    assert whole.colocated == 1 and "--no-chunked-prefill" in whole.role_args["colocated"]
    assert configs[1][1].role_args["colocated"][-1] == "64"
    disagg = configs[-1][1]
    assert disagg.colocated == 0 and disagg.prefill == 1 and disagg.decode == 1
    assert all(config.threads == 1 for _, config in configs)
