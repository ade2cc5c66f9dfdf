"""`kvmesh model ...`: build local checkpoints (`tiny`) and locate the default one (`default`)."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from kvmesh.models.tiny import ARCHS, SIZES


def register(subparsers: Any) -> None:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "model", help="build tiny random-weight checkpoints (see `kvmesh model --help`)"
    )
    inner = parser.add_subparsers(dest="model_command", metavar="ACTION", required=True)
    tiny = inner.add_parser("tiny", help="write a tiny checkpoint of WORKLOADS.md into DIR")
    tiny.add_argument("dir", metavar="DIR", help="output folder (created if missing)")
    tiny.add_argument("--arch", choices=ARCHS, default="llama")
    tiny.add_argument("--size", choices=SIZES, default="test")
    tiny.add_argument("--seed", type=int, default=0, help="torch seed for the weights")
    tiny.set_defaults(func=run_tiny)
    default = inner.add_parser("default", help="build (once) and print the default model folder")
    default.set_defaults(func=run_default)


def run_tiny(args: argparse.Namespace) -> int:
    from kvmesh.engine.errors import InvalidParameterError
    from kvmesh.models.tiny import build_tiny_model

    try:
        out = build_tiny_model(args.dir, args.arch, args.size, args.seed)
    except InvalidParameterError as error:
        print(f"kvmesh model tiny: {error}", file=sys.stderr)
        return 2
    print(out)
    return 0


def run_default(args: argparse.Namespace) -> int:
    from kvmesh.models.default import default_model_path

    print(default_model_path())
    return 0
