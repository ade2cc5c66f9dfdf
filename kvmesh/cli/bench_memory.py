"""`kvmesh bench memory`: workload W2, contiguous preallocation against paged KV blocks."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

BASELINE = "contiguous"
REFERENCE = "paged-16"
_COLUMNS: tuple[tuple[str, str], ...] = (
    ("utilization", "util"),
    ("kv_usage", "kv usage"),
    ("mean_concurrency", "mean conc"),
    ("peak_concurrency", "peak conc"),
    ("preemptions", "preempt"),
    ("steps", "steps"),
    ("internal_fragmentation", "internal frag"),
    ("external_fragmentation", "external frag"),
)


def register(subparsers: Any) -> None:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "memory", help="W2: contiguous preallocation vs paged KV blocks (simulation)"
    )
    parser.add_argument("--requests", type=int, default=2000, help="number of requests (W2: 2000)")
    parser.add_argument("--seed", type=int, default=0, help="random seed (W2: 0)")
    parser.add_argument("--json", action="store_true", help="print results as JSON")
    parser.set_defaults(func=run_bench_memory)


def run_bench_memory(args: argparse.Namespace) -> int:
    """Print per-allocator metrics and ratios against contiguous; exit 2 on bad input."""
    from kvmesh.memory.simulation import SimulationError, run_w2

    try:
        results = run_w2(num_requests=args.requests, seed=args.seed)
    except SimulationError as error:
        print(f"kvmesh bench memory: {error}", file=sys.stderr)
        return 2
    metrics = {name: result.to_dict() for name, result in results.items()}
    if args.json:
        print(json.dumps(metrics, indent=2))
    else:
        _print_tables(metrics, args)
    return 0


def ratios_vs_contiguous(metrics: dict[str, dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Per allocator: utilization, peak concurrency and steps divided by contiguous's."""
    base = metrics[BASELINE]
    return {
        name: {
            key: values[key] / base[key]
            for key in ("utilization", "peak_concurrency", "mean_concurrency", "steps")
        }
        for name, values in metrics.items()
    }


def _print_tables(metrics: dict[str, dict[str, Any]], args: argparse.Namespace) -> None:
    from rich.console import Console
    from rich.table import Table

    title = f"W2 memory: {args.requests} requests, seed {args.seed}, 65,536 slots"
    table = Table(title=title)
    table.add_column("allocator", no_wrap=True)
    for _, label in _COLUMNS:
        table.add_column(label, justify="right")
    for name, values in metrics.items():
        table.add_row(name, *(_format(values[key]) for key, _ in _COLUMNS))
    ratios = Table(title="ratios vs contiguous (steps: lower is better)")
    ratios.add_column("allocator", no_wrap=True)
    for label in ("utilization", "peak concurrency", "mean concurrency", "steps"):
        ratios.add_column(label, justify="right")
    for name, values in ratios_vs_contiguous(metrics).items():
        ratios.add_row(name, *(f"{value:.2f}x" for value in values.values()))
    console = Console()
    if not console.is_terminal:
        console = Console(width=120)
    console.print(table)
    console.print(ratios)


def _format(value: float | int) -> str:
    return f"{value:.3f}" if isinstance(value, float) else str(value)
