"""`kvmesh tune chunked-prefill`: sweep the step budget, chunk cap and scheduling policy.

Each setting of the grid (`kvmesh.loadgen.tuner`) runs the workload (W4-shaped by default) on a
freshly started embedded system (`--embedded colocated|disaggregated`, `--model`), measured
with the serving benchmark's client; with `--target HOST:PORT` the running system is measured
as it is (its flags are its own). Prints the table, writes a plot of throughput against p99
ITL (`--plot`), and prints the flags of the setting with the best goodput under the SLOs.
Exit status 0 with a recommendation, 1 when no setting meets the SLOs, 2 for bad input.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvmesh.cli.bench_serve import add_workload_flags, w4_shape
from kvmesh.cli.supervisor import ChildFailed
from kvmesh.loadgen.workloads import WorkloadError

DEFAULT_PLOT = "kvmesh-tune-chunked-prefill.png"


def register(subparsers: Any) -> None:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "tune", help="find engine settings for a workload (see `kvmesh tune --help`)"
    )
    inner = parser.add_subparsers(dest="tuner", metavar="TUNER", required=True)
    p = inner.add_parser("chunked-prefill", help="step budget, chunk cap and policy under SLOs")
    add = p.add_argument
    add("--slo-itl-p99", type=float, required=True, metavar="MS", help="p99 inter-token latency")
    add("--slo-ttft-p99", type=float, default=None, metavar="MS", help="p99 time to first token")
    add("--budgets", default="256,512,1024,2048", help="--max-num-batched-tokens values")
    add("--chunks", default="none,256",
        help="--long-prefill-token-threshold values (none: the budget)")  # fmt: skip
    add("--policies", default="decode-first,prefill-first", help="--scheduling-policy values")
    add("--target", default=None, help="measure this running front door instead (HOST:PORT)")
    add("--model", default=None, help="checkpoint of the embedded systems (default model)")
    add("--embedded", choices=("colocated", "disaggregated"), default="colocated",
        help="the embedded system of each setting (default %(default)s)")  # fmt: skip
    add(
        "--threads",
        type=int,
        default=None,
        help="torch threads per worker (default: the usable cores shared among the workers)",
    )
    add("--worker-args", default="", help="extra `kvmesh serve` worker flags for every setting")
    add_workload_flags(p, default="w4")
    add("--request-rate", type=float, default=math.inf,
        help="arrivals of workloads without a schedule (default inf: all at once)")  # fmt: skip
    add("--plot", default=DEFAULT_PLOT, metavar="PNG", help="(default %(default)s)")
    add("--json", action="store_true", help="print the table and pick as JSON")
    add("--no-progress", action="store_true", help="no progress bars")
    p.set_defaults(func=run_tune)


def run_tune(args: argparse.Namespace) -> int:
    from kvmesh.loadgen import plots, tuner

    try:
        settings = None if args.target else tuner.grid(
            [int(b) for b in args.budgets.split(",")], tuner.parse_chunks(args.chunks),
            [p.strip() for p in args.policies.split(",")])  # fmt: skip
        rows = measure_all(args, settings)
    except (ValueError, WorkloadError) as error:
        print(f"kvmesh tune chunked-prefill: {error}", file=sys.stderr)
        return 2
    except ChildFailed as error:  # a setting's system did not start
        print(f"kvmesh tune chunked-prefill: {error}", file=sys.stderr)
        return 1
    best = tuner.recommend(rows)
    plot = plots.tuner_scatter(rows, args.slo_itl_p99, Path(args.plot))
    slo = {"itl_p99_ms": args.slo_itl_p99, "ttft_p99_ms": args.slo_ttft_p99}
    if args.json:
        print(json.dumps({"slo": slo, "workload": args.workload, "rows": rows,
                          "recommended": best, "plot": str(plot)}))  # fmt: skip
    else:
        print_report(rows, best, slo, plot, system_flags(args))
    return 0 if best is not None else 1


def system_flags(args: argparse.Namespace) -> list[str]:
    """The `kvmesh up` flags of the system each setting ran on (its default is 1P+1D)."""
    words = ["--colocated", "1"] if args.embedded == "colocated" else []
    return words if args.threads is None else [*words, "--threads", str(args.threads)]


def measure_all(args: argparse.Namespace, settings: list[Any] | None) -> list[dict[str, Any]]:
    """A row per setting (or one for the running `--target`)."""
    from kvmesh.loadgen import tuner

    if settings is None:
        summary = asyncio.run(measure(args, args.target))
        return [tuner.row("running system", None, summary, args.slo_itl_p99, args.slo_ttft_p99)]
    from kvmesh.loadgen.session import Embedded, embedded

    rows = []
    for setting in settings:
        extra = (*shlex.split(args.worker_args), *setting.flags())  # the setting's flags win
        with embedded(Embedded(args.model, args.embedded, args.threads, extra)) as system:
            args.model = args.model or system.model_dir
            summary = asyncio.run(measure(args, system.endpoint, setting.name))
        rows.append(tuner.row(setting.name, setting, summary, args.slo_itl_p99, args.slo_ttft_p99))
        if not args.json and not args.no_progress:
            print(_line(rows[-1]), file=sys.stderr, flush=True)
    return rows


async def measure(args: argparse.Namespace, target: str, name: str = "") -> dict[str, Any]:
    """The summary of one run of the workload against `target` (gRPC)."""
    from kvmesh.loadgen import workloads
    from kvmesh.loadgen.backends import GrpcBackend
    from kvmesh.loadgen.metrics import Slo
    from kvmesh.loadgen.runner import Arrival
    from kvmesh.loadgen.session import sweep

    backend = GrpcBackend(target, timeout=600.0)
    try:
        requests = workloads.build(args.workload, await backend.vocab_size(), args.num_requests,
                                   args.seed, args.scale, w4_shape(args), args.trace)  # fmt: skip
        arrival = Arrival(rate=args.request_rate, seed=args.seed)
        slo = Slo(ttft_ms=args.slo_ttft_p99, itl_ms=args.slo_itl_p99)
        runs = await sweep(backend, requests, [arrival], slo, progress=not args.no_progress)
    finally:
        await backend.close()
    return dict(runs[0]["summary"])


def _line(row: dict[str, Any]) -> str:
    verdict = "meets" if row["meets_slo"] else "misses"
    return (f"{row['name']}: ITL p99 {row['itl_p99_ms']} ms, TTFT p99 {row['ttft_p99_ms']} ms, "
            f"{row['output_throughput']} tok/s ({verdict} the SLOs)")  # fmt: skip


def print_report(rows: list[dict[str, Any]], best: dict[str, Any] | None, slo: dict[str, Any],
                 plot: Path, up_flags: Sequence[str] = ()) -> None:  # fmt: skip
    from rich.console import Console
    from rich.table import Table

    title = (
        f"chunked-prefill settings (budget/chunk/policy); SLO ITL p99 <= {slo['itl_p99_ms']:g} ms"
    )
    if slo["ttft_p99_ms"]:
        title += f", TTFT p99 <= {slo['ttft_p99_ms']:g} ms"
    table = Table(title=title)
    for column in ("setting", "ITL p50", "ITL p99", "TTFT p99", "out tok/s", "goodput tok/s",
                   "ok/failed", "SLO", ""):  # fmt: skip
        table.add_column(column, justify="left" if column == "setting" else "right")
    for r in rows:
        table.add_row(r["name"], _ms(r["itl_p50_ms"]), _ms(r["itl_p99_ms"]), _ms(r["ttft_p99_ms"]),
                      f"{r['output_throughput']:.1f}", f"{r['goodput_output_throughput']:.1f}",
                      f"{r['completed']}/{r['failed']}", "yes" if r["meets_slo"] else "no",
                      "<- best" if r["recommended"] else "")  # fmt: skip
    console = Console(width=140)
    console.print(table)
    console.print(f"plot: {plot}")
    if best is None:
        console.print("no setting meets the SLOs: relax them, or try smaller budgets and chunks")
    elif best["flags"] is None:
        console.print("the running system meets the SLOs with its current flags")
    else:
        command = shlex.join(["kvmesh", "up", *up_flags, *best["flags"]])
        console.print(f"recommended: {best['name']}\n  {command}", markup=False, soft_wrap=True)


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"
