"""`kvmesh bench serve`: a serving benchmark against a running system, or one it starts.

Targets: `--target HOST:PORT` (kvmesh's gRPC front door), `--base-url URL` (any
OpenAI-compatible server, e.g. kvmesh's HTTP door or `vllm serve`; `--endpoint completions|chat`),
or neither: an embedded kvmesh (`--embedded disaggregated|colocated`, `--model`), driven over
gRPC or, with `--backend openai`, over its HTTP door. Workloads W1-W4 or a JSONL trace
(`kvmesh.loadgen.workloads`); arrivals Poisson or fixed-rate at `--request-rate` (a sweep with
`--rates`), or `--concurrency`. Prints a table of TTFT/TPOT/ITL/E2E percentiles, throughput and
goodput under the SLOs (`kvmesh.loadgen.metrics`), or `--json`; `--plot DIR` writes latency
CDFs and, for a sweep, throughput and latency against rate. `--from-json A.json B.json` plots
and tabulates saved results side by side (e.g. kvmesh next to vLLM).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import shlex
import sys
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from kvmesh.cli.supervisor import ChildFailed
from kvmesh.loadgen.runner import ARRIVALS, Arrival
from kvmesh.loadgen.workloads import WORKLOADS, W4Shape, WorkloadError

DEFAULT_TIMEOUT = 600.0


def register(subparsers: Any) -> None:
    p: argparse.ArgumentParser = subparsers.add_parser(
        "serve", help="serving benchmark over gRPC or an OpenAI-compatible HTTP API"
    )
    add = p.add_argument
    add("--target", default=None, help="kvmesh front door HOST:PORT (gRPC)")
    add("--base-url", default=None, help="OpenAI-compatible API, e.g. http://127.0.0.1:8000/v1")
    add("--endpoint", choices=("completions", "chat"), default="completions",
        help="OpenAI API to stream (default %(default)s; chat sends text prompts)")  # fmt: skip
    add("--served-model-name", default=None, help="`model` field (default: the server's first)")
    add("--api-key", default=None, help="bearer token for the target")
    add("--model", default=None,
        help="checkpoint of the embedded system, and the tokenizer/vocabulary of the prompts "
             "(default: the default model)")  # fmt: skip
    add("--embedded", choices=("disaggregated", "colocated"), default="disaggregated",
        help="without a target: the system to start (default %(default)s)")  # fmt: skip
    add("--backend", choices=("grpc", "openai"), default="grpc",
        help="without a target: drive the embedded system's gRPC or HTTP door")  # fmt: skip
    add("--threads", type=int, default=None, help="embedded: torch threads per worker")
    add("--worker-args", default="", help="embedded: extra `kvmesh serve` worker flags")
    add_workload_flags(p)
    add("--tokenizer", default=None, help="tokenizer folder for text prompts (default: --model)")
    add("--request-rate", type=float, default=math.inf,
        help="requests per second (default inf: all at once)")  # fmt: skip
    add("--rates", default=None, help="sweep these rates, e.g. 0.5,1,2 (overrides --request-rate)")
    add(
        "--arrival",
        choices=ARRIVALS,
        default="poisson",
        help="arrival process (default %(default)s)",
    )
    add("--concurrency", type=int, default=None, help="fixed concurrency instead of a rate")
    add("--warmup", type=int, default=1, help="unrecorded warm-up requests (default %(default)s)")
    add("--timeout", type=float, default=DEFAULT_TIMEOUT, help="per-request deadline (s)")
    add("--slo-ttft-ms", type=float, default=None, help="goodput: TTFT at most this")
    add("--slo-tpot-ms", type=float, default=None, help="goodput: TPOT at most this")
    add("--slo-itl-ms", type=float, default=None, help="goodput: a request's p99 ITL at most this")
    add("--label", default=None, help="name of this system in tables and plots")
    add("--json", action="store_true", help="print the result as JSON")
    add("--json-out", default=None, metavar="FILE", help="also write the JSON result here")
    add("--plot", default=None, metavar="DIR", help="write PNG plots into DIR")
    add("--from-json", nargs="+", default=None, metavar="FILE",
        help="no run: tabulate and plot saved --json results side by side")  # fmt: skip
    add("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=run_bench_serve)


def add_workload_flags(p: argparse.ArgumentParser, default: str = "w1") -> None:
    """The workload flags of `bench serve` and `tune` (`--tokenizer`, which only `bench serve`
    reads, is its own)."""
    add = p.add_argument
    add("--workload", choices=WORKLOADS, default=default, help="(default %(default)s)")
    add("--trace", default=None, metavar="JSONL", help="requests of --workload trace")
    add("--num-requests", type=int, default=None, help="W1-W3/trace: requests (default 64)")
    add("--seed", type=int, default=0, help="prompt and arrival seed (default %(default)s)")
    add("--scale", type=float, default=1.0, help="multiply every prompt/output length by this")
    shape = W4Shape()
    add("--w4-steady", type=int, default=shape.steady, help="W4: steady decoders")
    add("--w4-long", type=int, default=shape.long, help="W4: long prompts")
    add("--w4-interval", type=float, default=shape.interval, help="W4: seconds between long")


def w4_shape(args: argparse.Namespace) -> W4Shape:
    return W4Shape(steady=args.w4_steady, long=args.w4_long, interval=args.w4_interval)


def arrivals(args: argparse.Namespace) -> list[Arrival]:
    if args.concurrency is not None:
        return [Arrival(concurrency=args.concurrency, seed=args.seed)]
    rates = sweep_rates(args.rates) if args.rates else [args.request_rate]
    return [Arrival(rate=r, process=args.arrival, seed=args.seed) for r in rates]


def sweep_rates(text: str) -> list[float]:
    """The request rates of `--rates` (ValueError naming the flag unless positive numbers)."""
    try:
        rates = [float(r) for r in text.split(",")]
    except ValueError:
        rates = []
    if not rates or not all(r > 0 for r in rates):  # NaN is not > 0 either
        raise ValueError(f"--rates must be comma-separated positive numbers, got {text!r}")
    return rates


def run_bench_serve(args: argparse.Namespace) -> int:
    if args.from_json:
        results = [json.loads(Path(f).read_text()) for f in args.from_json]
    else:
        try:
            results = [asyncio.run(bench(args))]
        except (ValueError, WorkloadError) as error:
            print(f"kvmesh bench serve: {error}", file=sys.stderr)
            return 2
        except ChildFailed as error:  # the embedded system did not start
            print(f"kvmesh bench serve: {error}", file=sys.stderr)
            return 1
    if args.json:
        print(json.dumps(results[0] if len(results) == 1 else results))
    else:
        print_table(results)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(results[0]))
    if args.plot:
        for path in write_plots(results, Path(args.plot)):
            print(f"wrote {path}", file=sys.stderr)
    return 0 if every_run_completed(results) else 1


def every_run_completed(results: Sequence[dict[str, Any]]) -> bool:
    """Whether every run of every result (each rate of a sweep) completed a request."""
    return all(run["summary"]["completed"] for r in results for run in r["runs"])


async def bench(args: argparse.Namespace) -> dict[str, Any]:
    from kvmesh.loadgen.metrics import Slo
    from kvmesh.loadgen.session import sweep

    slo = Slo(args.slo_ttft_ms, args.slo_tpot_ms, args.slo_itl_ms)
    plan = arrivals(args)
    async with connect(args) as (backend, info):
        requests = await build_requests(args, backend, info)
        runs = await sweep(backend, requests, plan, slo, args.warmup, not args.no_progress)
    return {**info, "workload": args.workload, "num_requests": len(requests), "runs": runs}


@asynccontextmanager
async def connect(args: argparse.Namespace) -> AsyncIterator[tuple[Any, dict[str, Any]]]:
    """The backend to drive and what the result says about it (starting an embedded system
    when no target is given)."""
    from kvmesh.loadgen.backends import GrpcBackend, OpenAIBackend
    from kvmesh.loadgen.session import Embedded, embedded

    if args.target and args.base_url:
        raise ValueError("give --target (gRPC) or --base-url (HTTP), not both")
    system = None
    if args.target is None and args.base_url is None:
        extra = tuple(shlex.split(args.worker_args))
        spec = Embedded(args.model, args.embedded, args.threads, extra, args.backend == "openai")
        system = embedded(spec)
        started = system.__enter__()
        args.model = args.model or started.model_dir
        if args.backend == "openai":
            args.base_url = f"{started.http_url}/v1"
        else:
            args.target = started.endpoint
    try:
        if args.base_url:
            backend: Any = OpenAIBackend(args.base_url, args.timeout, args.endpoint,
                                         args.served_model_name, args.api_key)  # fmt: skip
        else:
            backend = GrpcBackend(args.target, args.timeout, api_key=args.api_key)
        kind = "openai" if args.base_url else "grpc"
        label = args.label or (f"kvmesh {args.embedded}" if system else kind)
        info = {"label": label, "backend": kind, "target": args.base_url or args.target,
                "endpoint": args.endpoint if args.base_url else None,
                "embedded": args.embedded if system else None, "model": args.model}  # fmt: skip
        try:
            yield backend, info
        finally:
            await backend.close()
    finally:
        if system is not None:
            system.__exit__(None, None, None)


async def build_requests(args: argparse.Namespace, backend: Any, info: dict[str, Any]) -> list:
    """The workload's requests: token ids over the model's vocabulary, text for chat."""
    from kvmesh.loadgen import workloads

    tokenizer_dir = args.tokenizer or args.model
    if hasattr(backend, "vocab_size"):
        vocab = await backend.vocab_size()
    elif tokenizer_dir:
        vocab = workloads.vocab_of(resolve(tokenizer_dir))
    else:
        raise ValueError("--base-url needs --model or --tokenizer (the prompts' vocabulary)")
    requests = workloads.build(args.workload, vocab, args.num_requests, args.seed, args.scale,
                               w4_shape(args), args.trace)  # fmt: skip
    if args.endpoint == "chat" and args.base_url:
        if not tokenizer_dir:
            raise ValueError("--endpoint chat needs --tokenizer (or --model) for text prompts")
        from transformers import AutoTokenizer

        requests = workloads.as_text(
            requests, AutoTokenizer.from_pretrained(resolve(tokenizer_dir))
        )
    return requests


def resolve(model: str) -> str:
    from kvmesh.cli.up import resolve_model

    return resolve_model(model)


def print_table(results: Sequence[dict[str, Any]]) -> None:
    from rich.console import Console
    from rich.table import Table

    from kvmesh.loadgen.metrics import LATENCIES

    table = Table(title="serving benchmark (latencies in ms, p50 / p99)")
    for column in ("system", "arrival", "ok/failed", "req/s", "out tok/s", "goodput req/s",
                   "TTFT", "TPOT", "ITL", "E2E"):  # fmt: skip
        table.add_column(column, justify="left" if column in ("system", "arrival") else "right")
    for result in results:
        for run in result["runs"]:
            s = run["summary"]
            table.add_row(result["label"], run["arrival"], f"{s['completed']}/{s['failed']}",
                          f"{s['request_throughput']:.2f}", f"{s['output_throughput']:.1f}",
                          f"{s['goodput']:.2f}", *(_pair(s[k]) for k in LATENCIES))  # fmt: skip
    console = Console(width=160)
    console.print(table)
    for result in results:
        for run in result["runs"]:
            failed, errors = run["summary"]["failed"], "; ".join(run["summary"]["errors"])
            if failed:
                line = f"{result['label']} {run['arrival']}: {failed} failed, e.g. {errors}"
                console.print(line, markup=False)


def _pair(d: dict[str, float] | None) -> str:
    return "-" if d is None else f"{d['p50']:.1f} / {d['p99']:.1f}"


def write_plots(results: Sequence[dict[str, Any]], folder: Path) -> list[Path]:
    """Latency CDFs; with more than one rate in any result, the rate sweep too."""
    from kvmesh.loadgen import plots

    paths = [plots.latency_cdfs(list(results), folder / "latency_cdf.png")]
    if any(len([r for r in res["runs"] if r["rate"] is not None]) > 1 for res in results):
        paths.append(plots.rate_sweep(list(results), folder / "rate_sweep.png"))
    return paths
