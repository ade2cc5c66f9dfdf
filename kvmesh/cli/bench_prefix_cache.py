"""`kvmesh bench prefix-cache`: a hot shared prefix under a flood of one-off prompts.

One request stream, replayed against each admission policy of the same `BlockManager` size:
a fraction of requests start with one hot prefix (plus a unique suffix), the rest are unique
prompts whose total size is many times the cache. Each request runs like the engine drives it
(lookup, allocate prompt + output, commit; at most `--concurrency` requests hold blocks, the
oldest is freed first). The
number that matters is the hot-prefix hit rate: cached hot tokens / cacheable hot tokens.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from collections import deque
from dataclasses import dataclass
from typing import Any

POLICIES = ("slru", "lru")


@dataclass(frozen=True)
class Workload:
    requests: int
    hot_fraction: float
    hot_tokens: int
    unique_min: int
    unique_max: int
    output_tokens: int
    cache_blocks: int
    block_size: int
    concurrency: int
    seed: int


def register(subparsers: Any) -> None:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "prefix-cache", help="hot-prefix hit rate under cache pollution: slru vs plain lru"
    )
    add = parser.add_argument
    add("--requests", type=int, default=2000, help="requests in the stream")
    add("--hot-fraction", type=float, default=0.25, help="share of requests with the hot prefix")
    add("--hot-tokens", type=int, default=500, help="length of the hot prefix")
    add("--unique-min", type=int, default=512, help="shortest unique prompt")
    add("--unique-max", type=int, default=1536, help="longest unique prompt")
    add("--output-tokens", type=int, default=32, help="output slots allocated per request")
    add("--cache-blocks", type=int, default=256, help="KV blocks in the pool")
    add("--block-size", type=int, default=16, help="token slots per block")
    add("--concurrency", type=int, default=2, help="requests holding blocks at once")
    add("--seed", type=int, default=0, help="random seed of the request stream")
    add("--json", action="store_true", help="print results as JSON")
    parser.set_defaults(func=run_bench_prefix_cache)


def make_stream(w: Workload) -> list[tuple[bool, list[int]]]:
    """(is_hot, prompt) per request; token ids of unique prompts never repeat."""
    rng = random.Random(w.seed)
    hot_prefix = [rng.randrange(10, 32000) for _ in range(w.hot_tokens)]
    next_token = 100_000
    stream = []
    for _ in range(w.requests):
        is_hot = rng.random() < w.hot_fraction
        length = rng.randint(16, 128) if is_hot else rng.randint(w.unique_min, w.unique_max)
        fresh = list(range(next_token, next_token + length))
        next_token += length
        stream.append((is_hot, hot_prefix + fresh if is_hot else fresh))
    return stream


def replay(w: Workload, stream: list[tuple[bool, list[int]]], admission: str) -> dict[str, Any]:
    """Run the stream through one BlockManager; hit rates and cache counters."""
    from kvmesh.memory import BlockManager

    manager = BlockManager(w.cache_blocks, w.block_size, hash_seed=b"bench", admission=admission)
    running: deque[str] = deque()
    cacheable_hot = w.hot_tokens // w.block_size * w.block_size
    hot_hits = hot_requests = 0
    for index, (is_hot, prompt) in enumerate(stream):
        while len(running) >= w.concurrency:
            manager.free(running.popleft())
        seq_id = f"r{index}"
        cached = manager.lookup_prefix(seq_id, prompt)
        while manager.allocate(seq_id, len(prompt) + w.output_tokens) is None:
            manager.free(running.popleft())  # cannot run dry: one request always fits
        manager.commit(seq_id, prompt, len(prompt))
        running.append(seq_id)
        if is_hot:
            hot_requests += 1
            hot_hits += min(cached, cacheable_hot)
    manager.check_integrity()
    metrics = manager.metrics()
    return {
        "hot_hit_rate": hot_hits / (hot_requests * cacheable_hot) if hot_requests else 0.0,
        "hot_requests": hot_requests,
        "prefix_hit_rate": metrics.prefix_hit_rate,
        "prefix_hit_tokens": metrics.prefix_hit_tokens,
        "evictions": metrics.evictions,
    }


def run_bench_prefix_cache(args: argparse.Namespace) -> int:
    """Print both policies side by side and the hot-hit-rate ratio; exit 2 on bad input."""
    workload = Workload(
        args.requests,
        args.hot_fraction,
        args.hot_tokens,
        args.unique_min,
        args.unique_max,
        args.output_tokens,
        args.cache_blocks,
        args.block_size,
        args.concurrency,
        args.seed,
    )
    error = _validate(workload)
    if error:
        print(f"kvmesh bench prefix-cache: {error}", file=sys.stderr)
        return 2
    stream = make_stream(workload)
    results = {policy: replay(workload, stream, policy) for policy in POLICIES}
    unique_tokens = sum(len(prompt) for is_hot, prompt in stream if not is_hot)
    report = {
        "workload": {
            **workload.__dict__,
            "unique_tokens_per_cache_slot": unique_tokens
            / (workload.cache_blocks * workload.block_size),
        },
        "policies": results,
        "hot_hit_rate_ratio_slru_vs_lru": _ratio(results["slru"], results["lru"]),
    }
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        _print_table(report)
    return 0


def _validate(w: Workload) -> str | None:
    if not 0.0 < w.hot_fraction <= 1.0:
        return f"--hot-fraction must be in (0, 1], got {w.hot_fraction}"
    if w.requests <= 0 or w.concurrency <= 0:
        return "--requests and --concurrency must be positive"
    if w.block_size <= 0 or w.hot_tokens < w.block_size:
        return f"--hot-tokens must cover at least one block of --block-size {w.block_size}"
    if not 0 < w.unique_min <= w.unique_max:
        return f"--unique-min/--unique-max must satisfy 0 < min <= max, got {w.unique_min}"
    longest = max(w.unique_max, w.hot_tokens + 128) + w.output_tokens
    if -(-longest // w.block_size) > w.cache_blocks:
        return f"--cache-blocks {w.cache_blocks} cannot hold one {longest}-token request"
    return None


def _ratio(ours: dict[str, Any], base: dict[str, Any]) -> float | None:
    return ours["hot_hit_rate"] / base["hot_hit_rate"] if base["hot_hit_rate"] else None


def _print_table(report: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    w = report["workload"]
    table = Table(
        title=f"prefix cache: {w['requests']} requests, {w['hot_fraction']:.0%} hot "
        f"({w['hot_tokens']}-token prefix), {w['cache_blocks']} blocks x {w['block_size']}, "
        f"unique prompts = {w['unique_tokens_per_cache_slot']:.0f}x the cache"
    )
    for label in ("admission", "hot hit rate", "all hit rate", "hot requests", "evictions"):
        table.add_column(label, justify="right")
    for policy, r in report["policies"].items():
        table.add_row(
            policy,
            f"{r['hot_hit_rate']:.3f}",
            f"{r['prefix_hit_rate']:.3f}",
            str(r["hot_requests"]),
            str(r["evictions"]),
        )
    ratio = report["hot_hit_rate_ratio_slru_vs_lru"]
    table.caption = f"hot hit rate slru / lru = {ratio:.2f}x" if ratio else "lru never hit"
    Console().print(table)
