"""`kvmesh bench ttft`: per-system configs, the unassigned remainder, bad --systems."""

from __future__ import annotations

import argparse
from types import SimpleNamespace

import pytest

from kvmesh.cli.bench_disagg import run_ttft, ttft_config, ttft_row


def args(**overrides: object) -> argparse.Namespace:
    values: dict[str, object] = {
        "model": "/models/m", "requests": 2, "prompt_len": 8, "max_tokens": 2,
        "systems": "colocated,disaggregated", "transfer_backend": "grpc", "threads": 1,
        "overlap": "off", "prefill_chunk": 64, "json": True,
    }  # fmt: skip
    values.update(overrides)
    return argparse.Namespace(**values)


def test_each_system_gets_its_own_workers_and_flags() -> None:
    colocated = ttft_config("colocated", args())
    assert (colocated.colocated, colocated.prefill, colocated.decode) == (1, 0, 0)
    assert colocated.role_args == {"colocated": ("--max-num-batched-tokens", "64")}
    disaggregated = ttft_config("disaggregated", args())
    assert (disaggregated.colocated, disaggregated.prefill, disaggregated.decode) == (0, 1, 1)
    assert disaggregated.transfer_backend == "grpc"
    assert disaggregated.role_args == {
        "prefill": ("--no-transfer-overlap", "--max-num-batched-tokens", "64")
    }


def test_overhead_is_what_no_phase_claims() -> None:
    usage = SimpleNamespace(
        ttft_seconds=0.030, queue_seconds=0.004, prefill_seconds=0.010,
        transfer_seconds=0.002, first_decode_seconds=0.001,
    )  # fmt: skip
    row = ttft_row(usage, client_ttft=0.033)
    assert row["overhead"] == pytest.approx(0.017)
    assert row["client_ttft"] == 0.033 and row["queue"] == 0.004


def test_unknown_system_is_refused_before_anything_starts() -> None:
    with pytest.raises(SystemExit, match="--systems: unknown"):
        run_ttft(args(systems="colocated,hybrid"))
