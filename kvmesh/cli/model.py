"""`kvmesh model ...`: build tiny checkpoints (`tiny`), prepare the default model (`default`),
convert a GGUF file (`convert`) and show where any `--model` value resolves (`path`)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from kvmesh.models.tiny import ARCHS, SIZES


def register(subparsers: Any) -> None:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "model", help="prepare model checkpoints (see `kvmesh model --help`)"
    )
    inner = parser.add_subparsers(dest="model_command", metavar="ACTION", required=True)
    tiny = inner.add_parser("tiny", help="write a tiny random-weight checkpoint into DIR")
    tiny.add_argument("dir", metavar="DIR", help="output folder (created if missing)")
    tiny.add_argument("--arch", choices=ARCHS, default="llama")
    tiny.add_argument("--size", choices=SIZES, default="test")
    tiny.add_argument("--seed", type=int, default=0, help="torch seed for the weights")
    tiny.set_defaults(func=run_tiny)
    default = inner.add_parser(
        "default", help="convert (once) and print the default model's folder (SmolLM2-135M)"
    )
    default.set_defaults(func=run_default)
    convert = inner.add_parser(
        "convert", help="convert a .gguf file into a checkpoint folder and print the folder"
    )
    convert.add_argument("file", metavar="FILE.gguf", help="GGUF file (a Llama-family model)")
    convert.add_argument(
        "dir", metavar="DIR", nargs="?", default=None, help="new output folder (default: cache)"
    )
    convert.set_defaults(func=run_convert)
    path = inner.add_parser("path", help="print the checkpoint folder a --model value stands for")
    path.add_argument("model", metavar="MODEL", help="folder, .gguf file or hub id Org/Name")
    path.set_defaults(func=run_path)


def _fail(action: str, error: Exception) -> int:
    print(f"kvmesh model {action}: {error}", file=sys.stderr)
    return 2


def run_tiny(args: argparse.Namespace) -> int:
    from kvmesh.engine.errors import InvalidParameterError
    from kvmesh.models.tiny import build_tiny_model

    try:
        out = build_tiny_model(args.dir, args.arch, args.size, args.seed)
    except InvalidParameterError as error:
        return _fail("tiny", error)
    print(out)
    return 0


def run_default(args: argparse.Namespace) -> int:
    from kvmesh.engine.errors import InvalidParameterError
    from kvmesh.models.default import default_model_path

    try:
        print(default_model_path())
    except InvalidParameterError as error:
        return _fail("default", error)
    return 0


def run_convert(args: argparse.Namespace) -> int:
    from kvmesh.engine.errors import InvalidParameterError
    from kvmesh.models.cache import build_atomically
    from kvmesh.models.gguf import convert_gguf, gguf_checkpoint

    source = Path(args.file)
    try:
        if not source.is_file():
            raise InvalidParameterError("file", f"{args.file!r}: no such file")
        if args.dir is None:
            print(gguf_checkpoint(source))
            return 0
        out = Path(args.dir)
        if out.exists():
            raise InvalidParameterError("dir", f"{args.dir!r} already exists")
        build_atomically(out, lambda staging: convert_gguf(source, staging))
    except InvalidParameterError as error:
        return _fail("convert", error)
    print(out)
    return 0


def run_path(args: argparse.Namespace) -> int:
    from kvmesh.engine.errors import InvalidParameterError
    from kvmesh.models.resolve import resolve_model_path

    try:
        print(resolve_model_path(args.model))
    except InvalidParameterError as error:
        return _fail("path", error)
    return 0
