"""`kvmesh serve ROLE ...`: start one role of a cluster (control, prefill, decode, colocated).

Each role's entry point is imported only when that role starts; every option after the role
is passed to it unchanged (`kvmesh serve control --help` shows the role's own options).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import Any

# role -> (module, function taking argv and returning an exit code)
ROLES: dict[str, tuple[str, str]] = {
    "control": ("control_plane.main", "run"),
    "prefill": ("prefill_svc.main", "run"),
    "decode": ("decode_svc.main", "run"),
    "colocated": ("decode_svc.colocated", "run"),
}


def register(subparsers: Any) -> None:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "serve", help="start one role of a cluster (see `kvmesh serve ROLE --help`)"
    )
    parser.add_argument("role", choices=sorted(ROLES), help="which role to start")
    parser.add_argument("role_args", nargs=argparse.REMAINDER, help="options of the role")
    parser.set_defaults(func=run_serve)


def run_serve(args: argparse.Namespace) -> int:
    module_name, function = ROLES[args.role]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        if error.name is None or not module_name.startswith(error.name):
            raise
        print(f"kvmesh serve {args.role}: this installation has no {args.role} role "
              f"({module_name} is missing)", file=sys.stderr)  # fmt: skip
        return 2
    return int(getattr(module, function)(list(args.role_args)) or 0)
