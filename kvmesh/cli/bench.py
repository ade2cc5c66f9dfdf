"""`kvmesh bench NAME`: benchmarks, each printing a table or `--json`.

Each benchmark is a module exposing `register(subparsers) -> None`; add it to BENCH_MODULES.
"""

from __future__ import annotations

import argparse
import importlib
from typing import Any

BENCH_MODULES: tuple[str, ...] = (
    "kvmesh.cli.bench_memory",
    "kvmesh.cli.bench_scheduler",
    "kvmesh.cli.bench_prefix_cache",
    "kvmesh.cli.bench_throughput",
    "kvmesh.cli.bench_kernels",
    "kvmesh.cli.bench_disagg",
    "kvmesh.cli.bench_transfer",
    "kvmesh.cli.bench_cold_start",
    "kvmesh.cli.bench_serve",
    "kvmesh.cli.bench_tiers",
)


def register(subparsers: Any) -> None:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "bench", help="run a benchmark (see `kvmesh bench --help`)"
    )
    inner = parser.add_subparsers(dest="bench", metavar="BENCHMARK", required=True)
    for name in BENCH_MODULES:
        importlib.import_module(name).register(inner)
