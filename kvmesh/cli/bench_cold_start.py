"""`kvmesh bench cold-start`: the first request's TTFT after SERVING against later ones.

Points the kernel cache (`KVMESH_CACHE_DIR`) at a fresh temporary folder, starts `kvmesh up`
(LocalSystem), and once the front door reports SERVING sends `--requests` requests one after
another, timing each one's first token. Reports the start-up time, every TTFT, and the first
request's TTFT over the last one's (and over the median of the others, steadier on a busy
host). `--warmup` sets the workers' `KVMESH_WARMUP` (full: kernels and one step before ready,
the default; kernels: kernels only; off: neither) to show what each part saves.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from typing import Any

PROMPT_IDS = list(range(3, 35))  # 32 tokens, fixed


def register(subparsers: Any) -> None:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "cold-start", help="first request's TTFT after SERVING vs later ones (fresh kernel cache)"
    )
    add = parser.add_argument
    add("--model", default=None, help="checkpoint folder (default: the default model)")
    add("--dtype", default="auto", help="worker --dtype (default %(default)s)")
    add("--colocated", action="store_true", help="one colocated worker instead of 1P+1D")
    add("--requests", type=int, default=10, help="sequential requests (default %(default)s)")
    add("--max-tokens", type=int, default=4, help="tokens per request (default %(default)s)")
    add(
        "--threads",
        type=int,
        default=None,
        help="torch threads per worker (default: the usable cores shared among the workers)",
    )
    add("--warmup", choices=("full", "kernels", "off"), default="full")
    add("--json", action="store_true", help="print the result as JSON")
    parser.set_defaults(func=run_cold_start)


def run_cold_start(args: argparse.Namespace) -> int:
    from kvmesh_kernels.cpu_build import isa_text, machine

    from kvmesh.cli.up import LocalSystem, UpConfig, resolve_model

    if args.requests < 2:
        print("kvmesh bench cold-start: --requests must be at least 2")
        return 2
    model = resolve_model(args.model)  # before the cache folder moves: the model stays put
    with tempfile.TemporaryDirectory(prefix="kvmesh-cold-") as cache:
        os.environ.update(KVMESH_CACHE_DIR=cache, KVMESH_WARMUP=args.warmup)
        pairs = 0 if args.colocated else 1
        config = UpConfig(model=model, prefill=pairs, decode=pairs, colocated=int(args.colocated),
                          port=0, threads=args.threads, startup_timeout=600.0,
                          worker_args=("--dtype", args.dtype))  # fmt: skip
        started = time.monotonic()
        with LocalSystem(config) as system:
            startup = time.monotonic() - started
            timed = [timed_request(system.endpoint, args.max_tokens) for _ in range(args.requests)]
            ttfts = [ttft for ttft, _ in timed]
            warmups = {w.child.name: w.ready.get("warmup", {}) for w in system.workers}
    result = {"model": model, "dtype": args.dtype, "warmup": args.warmup, "startup_s": startup,
              "ttft_s": ttfts, "first_over_last": ttfts[0] / ttfts[-1],
              "first_over_median": ttfts[0] / statistics.median(ttfts[1:]), "workers": warmups,
              "phases_ms": [phases for _, phases in timed],
              "isa": isa_text(machine())}  # fmt: skip
    print(json.dumps(result, indent=2) if args.json else table(result))
    return 0


def timed_request(endpoint: str, max_tokens: int) -> tuple[float, dict[str, float]]:
    """Seconds from sending a request to its first streamed chunk, and the front door's TTFT
    phases in ms (queue, prefill, transfer, first decode step)."""
    from kvmesh.client import Client

    with Client(endpoint, timeout=600.0) as client:
        started = time.monotonic()
        stream = iter(client.generate(PROMPT_IDS, max_tokens=max_tokens, ignore_eos=True))
        next(stream)
        first = time.monotonic() - started
        usage = [chunk.usage for chunk in stream if chunk.usage is not None]
    names = ("queue", "prefill", "transfer", "first_decode")
    phases = (
        {n: round(getattr(usage[-1], f"{n}_seconds") * 1000, 1) for n in names} if usage else {}
    )
    return first, phases


def table(result: dict[str, Any]) -> str:
    ttfts = result["ttft_s"]
    lines = [
        f"model {result['model']}  dtype {result['dtype']}  warmup {result['warmup']}  "
        f"ISA {result['isa']}",
        f"start-up to SERVING (fresh kernel cache): {result['startup_s']:.1f} s",
        *(f"  {name}: {w}" for name, w in result["workers"].items()),
        "request  TTFT ms",
        *(f"{i + 1:>7}  {t * 1000:8.1f}" for i, t in enumerate(ttfts)),
        f"phases of the first request (ms): {result['phases_ms'][0]}",
        f"phases of the last request (ms):  {result['phases_ms'][-1]}",
        f"first / request {len(ttfts)}: {result['first_over_last']:.2f}x; "
        f"first / median of the others: {result['first_over_median']:.2f}x",
    ]
    return "\n".join(lines)
