"""`kvmesh bench tiers`: W3-shaped prefixes under a device cache too small to hold them.

`--prefixes` system prompts of 500 tokens (default 4), requests cycling through them, each
with a unique suffix of randint(16, 128) ids and `--output-tokens` generated, arriving one by
one (the next when the previous has its first token). The device pool holds one request and a
little more, never the prefixes, so a prefix comes back by recompute (no tiers), from the host
tier, or from the disk tier (a host tier of 8 blocks above it). Reported: mean TTFT of each
after the first round (which is cold in all three); the reload path's bandwidth on one mean
reload batch of cached host slots into scattered device blocks, beside a plain contiguous copy
of the same number of host-tier bytes into the cache, both medians of 20 in the same run (and
the mean over the run's own reloads, which includes the engine thread's waits for a core).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from typing import Any

from kvmesh.cli.bench_throughput import bench_params
from kvmesh.cli.main import apply_omp_defaults

GIB = 1 << 30
SYSTEM_TOKENS = 500


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser("tiers", help="TTFT with host / disk KV tiers vs recompute")
    parser.add_argument("--model", default=None, help="checkpoint (default: tiny bench model)")
    parser.add_argument("--prefixes", type=int, default=4, help="shared system prompts")
    parser.add_argument("--num-requests", type=int, default=24)
    parser.add_argument("--output-tokens", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    parser.add_argument("--json", action="store_true", help="print results as JSON")
    parser.set_defaults(func=run_bench_tiers)


def requests(vocab: int, prefixes: int, count: int) -> list[list[int]]:
    rng = random.Random(0)
    systems = [
        [rng.randrange(10, vocab - 10) for _ in range(SYSTEM_TOKENS)] for _ in range(prefixes)
    ]
    return [
        systems[i % prefixes] + [rng.randrange(10, vocab - 10) for _ in range(rng.randint(16, 128))]
        for i in range(count)
    ]


def run_mode(model_dir: str, tiers: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """Mean TTFT after the first round, and the engine (for its tiers' counters)."""
    from kvmesh.engine.config import EngineConfig
    from kvmesh.engine.engine import LLMEngine

    block = 16
    device_blocks = -(-(SYSTEM_TOKENS + 128 + args.output_tokens) // block) + 8
    config = EngineConfig(
        model=model_dir, num_threads=args.threads, num_kv_blocks=device_blocks, **tiers
    )
    engine = LLMEngine(config)
    prompts = requests(engine.runner.vocab_size, args.prefixes, args.num_requests)
    ttfts: list[float] = []
    for i, prompt in enumerate(prompts):
        engine.add_request(f"t-{i}", prompt, bench_params(args.output_tokens))
        while engine.has_unfinished():
            for output in engine.step():
                if output.finished and output.metrics.ttft is not None:
                    ttfts.append(output.metrics.ttft)
    warm = ttfts[args.prefixes :]
    result: dict[str, Any] = {"ttft_mean_s": round(statistics.fmean(warm), 4), "engine": engine}
    return result


def plain_copy_gib_per_s(store: Any, num_blocks: int) -> float:
    """A plain copy of the same bytes: `num_blocks` host-tier rows into the cache's first
    blocks as one contiguous copy (numpy's memcpy on CPU, the faster one there; pinned ->
    device on CUDA), windows rotating over the host tier so the source is as cold as a
    reload's; median of 20."""
    import numpy as np
    import torch

    cache = store.device.cache.data
    dst = cache.view(torch.uint8).reshape(cache.shape[0], -1)[:num_blocks]
    host = store.host.data
    cuda = cache.device.type == "cuda"
    windows = max(1, store.host.num_used // num_blocks)
    times = []
    for index in range(20):
        first = (index % windows) * num_blocks
        src = host[first : first + num_blocks]
        if cuda:
            torch.cuda.synchronize(cache.device)
        started = time.perf_counter()
        if cuda:
            dst.copy_(src)
        else:
            np.copyto(dst.numpy(), src.numpy())
        if cuda:
            torch.cuda.synchronize(cache.device)
        times.append(time.perf_counter() - started)
    return int(dst.numel()) / statistics.median(times) / GIB


def reload_path_gib_per_s(store: Any, num_blocks: int) -> float:
    """The reload path itself (`DeviceBlocks.from_host`) on `num_blocks` cached host slots
    into scattered device blocks, windows rotating as in `plain_copy_gib_per_s`; median of 20."""
    import torch

    cached = sorted(store.host.cached_slots())
    device_blocks = store.device.cache.spec.num_blocks
    rng = random.Random(1)
    windows = max(1, len(cached) // num_blocks)
    times = []
    for index in range(20):
        first = (index % windows) * num_blocks
        slots = cached[first : first + num_blocks]
        blocks = rng.sample(range(device_blocks), len(slots))
        started = time.perf_counter()
        event = store.device.from_host(store.host, slots, blocks)
        if event is not None:
            event.synchronize()
        times.append(time.perf_counter() - started)
    if store.device.cache.data.device.type == "cuda":
        torch.cuda.synchronize()
    return num_blocks * store.device.block_bytes / statistics.median(times) / GIB


def run_bench_tiers(args: argparse.Namespace) -> int:
    apply_omp_defaults()
    import torch

    from kvmesh.engine.loader import resolve_model_path
    from kvmesh.models.tiny import tiny_model_path

    torch.set_num_threads(args.threads)
    model_dir = str(resolve_model_path(args.model) if args.model else tiny_model_path("bench"))
    recompute = run_mode(model_dir, {}, args)
    host = run_mode(model_dir, {"host_kv_gib": 1.0}, args)
    store = host["engine"].parts.tiers
    block_bytes = store.device.block_bytes
    with tempfile.TemporaryDirectory(prefix="kvmesh-bench-tiers-") as folder:
        disk_tiers = {"host_kv_gib": 8 * block_bytes / GIB, "disk_kv_dir": folder}
        disk = run_mode(model_dir, disk_tiers, args)
        disk["tiers"] = disk["engine"].parts.tiers.metrics()[1].as_dict()
        disk["engine"].close()
    stats = store.host_stats
    batch_bytes = stats.copy_bytes // max(1, stats.reload_batches)
    result = {
        "model": model_dir,
        "dtype": str(host["engine"].runner.loaded.dtype).removeprefix("torch."),
        "device": str(store.device.cache.data.device),
        "block_bytes": block_bytes,
        "requests": args.num_requests,
        "prefixes": args.prefixes,
        "recompute_ttft_mean_s": recompute["ttft_mean_s"],
        "host_ttft_mean_s": host["ttft_mean_s"],
        "disk_ttft_mean_s": disk["ttft_mean_s"],
        "host_over_recompute": round(host["ttft_mean_s"] / recompute["ttft_mean_s"], 3),
        "disk_over_recompute": round(disk["ttft_mean_s"] / recompute["ttft_mean_s"], 3),
        "reload_batch_bytes": batch_bytes,
        "reload_gib_per_s": round(reload_path_gib_per_s(store, batch_bytes // block_bytes), 2),
        "memcpy_gib_per_s": round(plain_copy_gib_per_s(store, batch_bytes // block_bytes), 2),
        "reload_in_run_gib_per_s": round(stats.copy_bytes / max(stats.copy_seconds, 1e-9) / GIB, 2),
        "host_tier": {k: v for k, v in store.metrics()[0].as_dict().items() if k != "tier"},
        "disk_tier": {k: v for k, v in disk["tiers"].items() if k != "tier"},
    }
    result["reload_over_memcpy"] = round(result["reload_gib_per_s"] / result["memcpy_gib_per_s"], 3)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        for key, value in result.items():
            print(f"{key:>24}: {value}")
    return 0
