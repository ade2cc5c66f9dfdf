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
    "kvmesh.cli.kernels",
    "kvmesh.cli.tune",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvmesh",
        description="Disaggregated prefill/decode LLM serving on a paged KV cache.",
    )
    parser.add_argument("--version", action="version", version=f"kvmesh {package_version()}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(subparsers)
    add_log_flags_everywhere(parser)
    return parser


def add_log_flags_everywhere(parser: argparse.ArgumentParser, subcommand: bool = False) -> None:
    """`--log-level` / `--log-format` on `parser` and every (nested) subcommand."""
    from kvmesh.telemetry.logs import add_log_flags

    add_log_flags(parser, subcommand=subcommand)
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in dict.fromkeys(action.choices.values()):
                add_log_flags_everywhere(sub, subcommand=True)


def package_version() -> str:
    """The installed distribution's version (the source tree's when it is not installed)."""
    from importlib import metadata

    try:
        return metadata.version("kvmesh")
    except metadata.PackageNotFoundError:
        import kvmesh

        return kvmesh.__version__


# OpenMP workers wait for the next parallel region by spinning, then sleeping. A process that
# has its cores to itself gains from a bounded spin: sleeping at once (OMP_WAIT_POLICY=PASSIVE)
# pays a futex wake-up on every matmul and attention call (W1 in bfloat16 ran 26-28% slower).
# Processes that share cores lose badly from any spin: two W1 engines on two cores ran at
# 235 tok/s each spinning against about 600 passive (docs/BENCHMARKS.md "OpenMP wait policy").
# So a single engine spins a bounded number of iterations (GOMP_SPINCOUNT) then sleeps; `kvmesh up`,
# which starts several workers on one host, makes them all passive (so do `kvmesh tune` and
# `kvmesh bench serve`, which start systems like it). Applied before torch loads
# OpenMP (commands import torch only when they run); an explicit OMP_WAIT_POLICY or
# GOMP_SPINCOUNT wins.
OMP_SPIN_DEFAULT = "20000"
SHARED_CORE_COMMANDS = ("up", "tune")


def apply_omp_defaults(shares_cores: bool = False) -> None:
    """Set the OpenMP wait default (passive when `shares_cores`, else a bounded spin) unless
    the user chose a wait policy or spin count. Child processes inherit it."""
    if "OMP_WAIT_POLICY" in os.environ or "GOMP_SPINCOUNT" in os.environ:
        return
    if shares_cores:
        os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    else:
        os.environ["GOMP_SPINCOUNT"] = OMP_SPIN_DEFAULT


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    serving_bench = args.command == "bench" and args.bench == "serve"  # may start a system
    apply_omp_defaults(shares_cores=args.command in SHARED_CORE_COMMANDS or serving_bench)
    from kvmesh.telemetry.logs import setup_from_args

    setup_from_args(args, f"kvmesh-{args.command}")
    result = args.func(args)
    return int(result or 0)


if __name__ == "__main__":
    sys.exit(main())
