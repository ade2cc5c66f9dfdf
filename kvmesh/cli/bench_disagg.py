"""`kvmesh bench ttft` and `kvmesh bench w4`: end-to-end benchmarks on a local system.

Both start the system with `kvmesh.cli.up.LocalSystem` (one process per role) and measure from
the client side with `kvmesh.client.AsyncClient`.

- ttft: N sequential requests (after one warm-up) against each system in `--systems`
  (colocated: one colocated worker; disaggregated: one prefill and one decode worker). Per
  system the p50 of the front door's TTFT, of the usage's TtftBreakdown phases (prefill,
  transfer, first decode) and of `overhead`, the part of each request's TTFT that no phase
  claims (queueing, routing, the control plane's calls and hops), beside the client-observed
  TTFT. `--overlap on|off` is the prefill worker's `--transfer-overlap` (each chunk's blocks sent
  while the next chunk computes); `--prefill-chunk` the prefill worker's
  `--max-num-batched-tokens`.
- w4 (docs/BENCHMARK_SUITE.md): 16 steady decoders (prompt 128, output 512) while
  2048-token prompts arrive
  every 2 s (output 16), for colocated without chunked prefill, colocated with chunked prefill at
  each `--chunks` size, and disaggregated; every worker uses `--threads` torch threads (1).
  Reports inter-token latency p50/p99 of the steady decoders (gaps between streamed chunks) and
  the long prompts' TTFT. `--scale` multiplies every length (prompts and outputs) to shrink it;
  `--interval` changes the arrival period and `--max-long` caps the number of long prompts (both
  deviations from W4, for machines where the long prompts arrive faster than one thread
  prefills them).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from kvmesh.v1.transfer import DEFAULT_BACKEND, WORKER_BACKENDS

W4 = {"steady": 16, "steady_prompt": 128, "steady_output": 512, "long_prompt": 2048,
      "long_output": 16, "interval": 2.0}  # fmt: skip


def register(subparsers: Any) -> None:
    ttft = subparsers.add_parser("ttft", help="TTFT breakdown per system (p50 of each phase)")
    ttft.add_argument("--model", default=None, help="checkpoint (default: the test-size tiny)")
    ttft.add_argument("--requests", type=int, default=20)
    ttft.add_argument("--prompt-len", type=int, default=256)
    ttft.add_argument("--max-tokens", type=int, default=8)
    ttft.add_argument("--systems", default="colocated,disaggregated",
                      help="comma-separated: colocated, disaggregated")  # fmt: skip
    ttft.add_argument("--transfer-backend", default=DEFAULT_BACKEND, choices=WORKER_BACKENDS)
    ttft.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch threads per worker (default: the usable cores shared among the workers)",
    )
    ttft.add_argument("--overlap", default="on", choices=("on", "off"),
                      help="the prefill worker's --transfer-overlap")  # fmt: skip
    ttft.add_argument("--prefill-chunk", type=int, default=None,
                      help="prefill worker's --max-num-batched-tokens (chunk size)")  # fmt: skip
    ttft.add_argument("--json", action="store_true")
    ttft.set_defaults(func=run_ttft)
    w4 = subparsers.add_parser("w4", help="W4 prefill interference: colocated vs disaggregated")
    w4.add_argument("--model", default=None, help="checkpoint (default: the bench-size tiny)")
    w4.add_argument("--scale", type=float, default=1.0, help="multiply every length by this")
    w4.add_argument("--chunks", default="256,512,1024", help="chunked-prefill sizes to sweep")
    w4.add_argument("--modes", default="colocated,chunked,disaggregated")
    w4.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    w4.add_argument("--transfer-backend", default=DEFAULT_BACKEND, choices=WORKER_BACKENDS)
    w4.add_argument("--interval", type=float, default=W4["interval"],
                    help="seconds between long prompts (W4: 2)")  # fmt: skip
    w4.add_argument("--max-long", type=int, default=0,
                    help="at most this many long prompts (0: until decoders end)")  # fmt: skip
    w4.add_argument("--json", action="store_true")
    w4.set_defaults(func=run_w4)


# -- TTFT ------------------------------------------------------------------------------------


TTFT_KEYS = ("ttft", "prefill", "transfer", "first_decode", "overhead", "queue", "client_ttft")
TTFT_SYSTEMS = ("colocated", "disaggregated")


def ttft_config(system: str, args: argparse.Namespace) -> Any:
    """The UpConfig of one system of `kvmesh bench ttft`."""
    from kvmesh.cli.up import UpConfig
    from kvmesh.models.tiny import tiny_model_path

    role_args: dict[str, tuple[str, ...]] = {}
    chunk = ("--max-num-batched-tokens", str(args.prefill_chunk)) if args.prefill_chunk else ()
    common: dict[str, Any] = {"model": args.model or str(tiny_model_path()), "port": 0,
                              "threads": args.threads}  # fmt: skip
    if system == "colocated":
        role_args["colocated"] = chunk
        return UpConfig(colocated=1, prefill=0, decode=0, role_args=role_args, **common)
    overlap = "--transfer-overlap" if args.overlap == "on" else "--no-transfer-overlap"
    role_args["prefill"] = (overlap, *chunk)
    return UpConfig(transfer_backend=args.transfer_backend, role_args=role_args, **common)


def run_ttft(args: argparse.Namespace) -> int:
    from kvmesh.cli.up import LocalSystem

    systems = [s for s in args.systems.split(",") if s]
    unknown = sorted(set(systems) - set(TTFT_SYSTEMS))
    if unknown:
        raise SystemExit(f"--systems: unknown {unknown}; choose from {TTFT_SYSTEMS}")
    p50: dict[str, dict[str, float]] = {}
    for system in systems:
        with LocalSystem(ttft_config(system, args)) as running:
            rows = asyncio.run(_ttft_requests(running.endpoint, args))[1:]  # first: warm-up
        p50[system] = {k: statistics.median(r[k] for r in rows) for k in TTFT_KEYS}
    if args.json:
        print(json.dumps({"requests": args.requests, "prompt_len": args.prompt_len,
                          "backend": args.transfer_backend, "overlap": args.overlap,
                          "prefill_chunk": args.prefill_chunk, "p50_seconds": p50}))  # fmt: skip
        return 0
    print(f"TTFT over {args.requests} requests, prompt {args.prompt_len} tokens, "
          f"transfer {args.transfer_backend} (overlap {args.overlap}), prefill chunk "
          f"{args.prefill_chunk or 'default'} (p50, ms; overhead = TTFT - prefill - transfer "
          "- first decode)")  # fmt: skip
    print(f"  {'':<13}" + "".join(f"{s:>15}" for s in systems))
    for key in TTFT_KEYS:
        print(f"  {key:<13}" + "".join(f"{p50[s][key] * 1000:15.2f}" for s in systems))
    return 0


async def _ttft_requests(endpoint: str, args: argparse.Namespace) -> list[dict[str, float]]:
    from kvmesh.client import AsyncClient

    rng = random.Random(0)
    rows = []
    async with AsyncClient(endpoint, timeout=300) as client:
        info = await client.model_info()
        for _ in range(args.requests + 1):
            prompt = [rng.randrange(1, info.vocab_size) for _ in range(args.prompt_len)]
            start, first = time.perf_counter(), None
            usage = None
            async for chunk in client.generate(prompt, max_tokens=args.max_tokens,
                                               temperature=0.0, ignore_eos=True):  # fmt: skip
                first = first or time.perf_counter()
                usage = chunk.usage or usage
            assert usage is not None and first is not None
            rows.append(ttft_row(usage, first - start))
    return rows


def ttft_row(usage: Any, client_ttft: float) -> dict[str, float]:
    """One request's TTFT phases (seconds); `overhead` is what no phase claims."""
    row = {"client_ttft": client_ttft, "ttft": usage.ttft_seconds,
           "queue": usage.queue_seconds, "prefill": usage.prefill_seconds,
           "transfer": usage.transfer_seconds,
           "first_decode": usage.first_decode_seconds}  # fmt: skip
    row["overhead"] = row["ttft"] - row["prefill"] - row["transfer"] - row["first_decode"]
    return row


# -- W4 --------------------------------------------------------------------------------------


@dataclass
class W4Result:
    mode: str
    itl_p50_ms: float
    itl_p99_ms: float
    long_ttft_mean_ms: float
    long_ttft_max_ms: float
    long_prompts: int
    seconds: float
    itl_samples: list[float] = field(default_factory=list, repr=False)


def bench_model_path() -> str:
    """The bench-size tiny checkpoint, built once into the kvmesh cache."""
    from kvmesh.models.tiny import tiny_model_path

    return str(tiny_model_path("bench"))


def w4_configs(args: argparse.Namespace, long_prompt: int) -> list[tuple[str, Any]]:
    """(label, UpConfig) for every requested mode."""
    from kvmesh.cli.up import UpConfig

    model = args.model or bench_model_path()
    max_len = long_prompt + 64
    common: dict[str, Any] = {"model": model, "port": 0, "threads": args.threads,
                              "worker_args": ("--num-kv-blocks", "2048", "--max-model-len",
                                              str(max(max_len, 1024)))}  # fmt: skip
    whole = ("--no-chunked-prefill", "--max-num-batched-tokens", str(max(max_len, 1024)))
    modes = args.modes.split(",")
    configs: list[tuple[str, Any]] = []
    if "colocated" in modes:
        configs.append(("colocated, no chunking",
                        UpConfig(colocated=1, prefill=0, decode=0, role_args={"colocated": whole},
                                 **common)))  # fmt: skip
    if "chunked" in modes:
        for chunk in (int(c) for c in args.chunks.split(",") if c):
            extra = ("--max-num-batched-tokens", str(chunk))
            configs.append((f"colocated, chunk {chunk}",
                            UpConfig(colocated=1, prefill=0, decode=0,
                                     role_args={"colocated": extra}, **common)))  # fmt: skip
    if "disaggregated" in modes:
        configs.append(("disaggregated 1P+1D",
                        UpConfig(transfer_backend=args.transfer_backend, **common)))  # fmt: skip
    return configs


def run_w4(args: argparse.Namespace) -> int:
    from kvmesh.cli.up import LocalSystem

    sizes = {k: (max(1, round(v * args.scale)) if k in
                 ("steady_prompt", "steady_output", "long_prompt") else v)
             for k, v in W4.items()}  # fmt: skip
    sizes["interval"] = args.interval
    sizes["max_long"] = args.max_long
    if not args.json:
        print(f"W4: {sizes['steady']} decoders (prompt {sizes['steady_prompt']}, output "
              f"{sizes['steady_output']}), long prompts of {sizes['long_prompt']} tokens (output "
              f"{sizes['long_output']}) every {args.interval:g} s"
              + (f", at most {args.max_long}" if args.max_long else "")
              + f"; {args.threads} thread(s) per worker", flush=True)  # fmt: skip
    results = []
    for label, config in w4_configs(args, int(sizes["long_prompt"])):
        with LocalSystem(config) as system:
            result = asyncio.run(w4_once(system.endpoint, sizes, label))
        results.append(result)
        if not args.json:
            print(f"{label:<26} ITL p50 {result.itl_p50_ms:7.1f} ms  p99 {result.itl_p99_ms:7.1f} "
                  f"ms  long TTFT mean {result.long_ttft_mean_ms:8.1f} ms  max "
                  f"{result.long_ttft_max_ms:8.1f} ms  ({result.long_prompts} long, "
                  f"{result.seconds:.0f} s)", flush=True)  # fmt: skip
    if args.json:
        rows = [{k: v for k, v in asdict(r).items() if k != "itl_samples"} for r in results]
        print(json.dumps({"sizes": sizes, "threads": args.threads, "results": rows}))
    return 0


async def w4_once(endpoint: str, sizes: dict[str, Any], label: str) -> W4Result:
    """Run the W4 mix once against `endpoint`."""
    from kvmesh.client import AsyncClient

    rng = random.Random(4)
    async with AsyncClient(endpoint, timeout=1800) as client:
        vocab = (await client.model_info()).vocab_size
        # Warm-up (not measured): one short request through the whole path.
        async for _ in client.generate([rng.randrange(1, vocab) for _ in range(16)],
                                       max_tokens=4, temperature=0.0, ignore_eos=True):  # fmt: skip
            pass

        def prompt(n: int) -> list[int]:
            return [rng.randrange(1, vocab) for _ in range(n)]

        async def stream(p: list[int], max_tokens: int) -> list[float]:
            times = []
            async for chunk in client.generate(p, max_tokens=max_tokens, temperature=0.0,
                                               ignore_eos=True):  # fmt: skip
                if chunk.token_ids:
                    times.append(time.perf_counter())
            return times

        start = time.perf_counter()
        steady = [asyncio.create_task(stream(prompt(sizes["steady_prompt"]),
                                             sizes["steady_output"]))
                  for _ in range(sizes["steady"])]  # fmt: skip
        long_ttfts: list[float] = []
        pending: list[asyncio.Task[None]] = []

        async def long_one() -> None:
            sent = time.perf_counter()
            times = await stream(prompt(sizes["long_prompt"]), sizes["long_output"])
            long_ttfts.append(times[0] - sent)

        max_long = int(sizes.get("max_long") or 0)
        while not all(t.done() for t in steady):
            if not max_long or len(pending) < max_long:
                pending.append(asyncio.create_task(long_one()))
            await asyncio.wait(steady, timeout=sizes["interval"])
        await asyncio.gather(*pending)
        gaps = [b - a for t in steady for a, b in zip(t.result(), t.result()[1:], strict=False)]
    return W4Result(
        mode=label,
        itl_p50_ms=_quantile(gaps, 0.50) * 1000,
        itl_p99_ms=_quantile(gaps, 0.99) * 1000,
        long_ttft_mean_ms=statistics.fmean(long_ttfts) * 1000,
        long_ttft_max_ms=max(long_ttfts) * 1000,
        long_prompts=len(long_ttfts),
        seconds=time.perf_counter() - start,
        itl_samples=gaps,
    )


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]
