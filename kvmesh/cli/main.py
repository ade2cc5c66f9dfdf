"""`kvmesh` entry point.

Each subcommand lives in its own module under `kvmesh.cli` exposing
`register(subparsers) -> None`; the module sets `func` on its parser via `set_defaults`.
Modules are imported only when the CLI starts, and heavy imports (torch) happen inside the
command functions, so `kvmesh --help` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Sequence

# Subcommand modules, in help order. `bench` is itself a group of benchmarks.
COMMAND_MODULES: tuple[str, ...] = (
    "kvmesh.cli.bench",
    "kvmesh.cli.plan",
    "kvmesh.cli.model",
    "kvmesh.cli.serve",
    "kvmesh.cli.up",
    "kvmesh.cli.generate",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvmesh",
        description="Disaggregated prefill/decode LLM serving on a paged KV cache.",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(subparsers)
    return parser


# OpenMP workers wait for the next parallel region by spinning, then sleeping. Unbounded
# spinning (OMP_WAIT_POLICY=ACTIVE) steals the cores from other processes on a shared host;
# sleeping at once (PASSIVE) pays a futex wake-up on every matmul and attention call, which
# cost W1 about 30% on a quiet machine (docs/BENCHMARKS.md "OpenMP wait policy"). The default
# spins a bounded number of iterations (about a millisecond) and then sleeps. Applied before
# torch loads OpenMP; an explicit OMP_WAIT_POLICY or GOMP_SPINCOUNT wins.
OMP_SPIN_DEFAULT = "20000"


def apply_omp_defaults() -> None:
    """Set the bounded-spin default unless the user chose a wait policy or spin count."""
    if "OMP_WAIT_POLICY" in os.environ or "GOMP_SPINCOUNT" in os.environ:
        return
    os.environ["GOMP_SPINCOUNT"] = OMP_SPIN_DEFAULT


def main(argv: Sequence[str] | None = None) -> int:
    apply_omp_defaults()
    parser = build_parser()
    args = parser.parse_args(argv)
    result = args.func(args)
    return int(result or 0)


if __name__ == "__main__":
    sys.exit(main())
