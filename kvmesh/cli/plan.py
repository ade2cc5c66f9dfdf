"""`kvmesh plan PATH`: KV bytes per token, blocks and concurrency that fit on a device."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

_ROWS: tuple[tuple[str, str], ...] = (
    ("kv_dtype", "KV dtype"),
    ("kv_bytes_per_token", "KV bytes per token"),
    ("scale_bytes_per_token_head", "scale bytes per token per kv head"),
    ("block_size", "block size (tokens)"),
    ("block_bytes", "bytes per block"),
    ("memory_bytes", "device memory"),
    ("utilization", "utilization"),
    ("weights_bytes", "weights (safetensors headers)"),
    ("kv_budget_bytes", "KV budget"),
    ("num_blocks", "blocks"),
    ("token_capacity", "token capacity"),
    ("max_model_len", "max model length"),
    ("max_concurrency", "max concurrency (paged)"),
    ("contiguous_max_concurrency", "max concurrency (contiguous)"),
)
_BYTE_FIELDS = frozenset(
    {"kv_bytes_per_token", "block_bytes", "memory_bytes", "weights_bytes", "kv_budget_bytes"}
)


def register(subparsers: Any) -> None:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "plan", help="plan KV cache capacity for a model config on a device"
    )
    parser.add_argument("path", type=Path, help="config.json or a model folder")
    parser.add_argument("--gpu-memory", default="80GiB", help="device memory (80GiB, 80GB, ...)")
    parser.add_argument("--utilization", type=float, default=0.9, help="fraction of memory used")
    parser.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    parser.add_argument(
        "--kv-dtype",
        default="auto",
        help="auto (model dtype), float32, float16, bfloat16, fp8 or int8",
    )
    parser.add_argument("--max-model-len", type=int, default=None, help="tokens per sequence")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    parser.set_defaults(func=run_plan)


def run_plan(args: argparse.Namespace) -> int:
    """Print the plan; exit code 2 with a one-line message naming the field on bad input."""
    from kvmesh.memory.planner import (
        KVModelShape,
        PlannerError,
        parse_bytes,
        plan_kv_capacity,
        safetensors_weights_bytes,
    )

    try:
        shape = KVModelShape.from_config(args.path)
        folder = args.path if args.path.is_dir() else args.path.parent
        plan = plan_kv_capacity(
            shape,
            memory_bytes=parse_bytes(args.gpu_memory, "gpu_memory"),
            utilization=args.utilization,
            weights_bytes=safetensors_weights_bytes(folder),
            block_size=args.block_size,
            kv_dtype=args.kv_dtype,
            max_model_len=args.max_model_len,
        )
    except PlannerError as error:
        print(f"kvmesh plan: {error}", file=sys.stderr)
        return 2
    fields = plan.to_dict()
    fields["model_type"] = shape.model_type
    if args.json:
        print(json.dumps(fields, indent=2))
    else:
        _print_table(fields)
    return 0


def _print_table(fields: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"KV capacity plan ({fields['model_type']})")
    table.add_column("quantity")
    table.add_column("value", justify="right")
    for key, label in _ROWS:
        value = fields[key]
        table.add_row(label, _human_bytes(value) if key in _BYTE_FIELDS else str(value))
    Console().print(table)


def _human_bytes(value: int) -> str:
    size = float(value)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            text = f"{size:.0f}" if size == int(size) else f"{size:.2f}"
            return f"{text} {unit}"
        size /= 1024
    raise AssertionError("unreachable")
