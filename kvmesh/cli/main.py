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


# Idle OpenMP threads spin by default; with several kvmesh processes (or a benchmark peer) on
# the same cores that spinning costs several times the work itself (measured about 5x on W1,
# see docs/BENCHMARKS.md). Set before torch loads; an explicit user value wins.
OMP_DEFAULTS = {"OMP_WAIT_POLICY": "PASSIVE"}


def main(argv: Sequence[str] | None = None) -> int:
    for name, value in OMP_DEFAULTS.items():
        os.environ.setdefault(name, value)
    parser = build_parser()
    args = parser.parse_args(argv)
    result = args.func(args)
    return int(result or 0)


if __name__ == "__main__":
    sys.exit(main())
