"""BlockManager micro-benchmark: operations per second (best of `--repeats` rounds).

    .venv/bin/python bench/alloc_bench.py [--blocks 4096] [--block-size 16] [--json]

Operations: allocate+free of a 512-token sequence; allocate one more token (decode, crossing a
block boundary every `block_size` calls); lookup_prefix hitting a cached 512-token prefix (then
free); commit of a 512-token prompt (then free); and one decode step of 256 sequences (each
allocates one more token and reads its new slot), reported as microseconds per step.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable

from kvmesh.memory import BlockManager

PROMPT = list(range(512))


def best_rate(run_round: Callable[[], int], repeats: int) -> float:
    """Highest operations/second over `repeats` rounds; `run_round` returns its op count."""
    best = 0.0
    for _ in range(repeats):
        start = time.perf_counter()
        ops = run_round()
        best = max(best, ops / (time.perf_counter() - start))
    return best


def allocate_free(m: BlockManager, n: int) -> Callable[[], int]:
    def run() -> int:
        for _ in range(n):
            m.allocate("s", 512)
            m.free("s")
        return n

    return run


def append_token(m: BlockManager, n: int) -> Callable[[], int]:
    def run() -> int:
        m.allocate("s", 1)
        for tokens in range(2, n + 2):
            m.allocate("s", tokens)
        m.free("s")
        return n

    return run


def lookup_hit(m: BlockManager, n: int) -> Callable[[], int]:
    m.lookup_prefix("warm", PROMPT)
    m.allocate("warm", 512)
    m.commit("warm", PROMPT, 512)
    m.free("warm")

    def run() -> int:
        for _ in range(n):
            assert m.lookup_prefix("s", PROMPT) == 496
            m.free("s")
        return n

    return run


def commit(m: BlockManager, n: int) -> Callable[[], int]:
    def run() -> int:
        for i in range(n):
            prompt = [i, *PROMPT[1:]]
            m.allocate("s", 512)
            m.commit("s", prompt, 512)
            m.free("s")
        return n

    return run


def decode_step_us(m: BlockManager, batch: int, steps: int) -> float:
    """Mean microseconds for one step of `batch` sequences each appending one token."""
    seqs = [f"s{i}" for i in range(batch)]
    for seq_id in seqs:
        m.allocate(seq_id, 100)
    start = time.perf_counter()
    for step in range(steps):
        total = 101 + step
        for seq_id in seqs:
            assert m.allocate(seq_id, total) is not None
            m.slot_mapping(seq_id, total - 1, total)
    elapsed = time.perf_counter() - start
    for seq_id in seqs:
        m.free(seq_id)
    return elapsed / steps * 1e6


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=4096)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--ops", type=int, default=2000, help="operations per round")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)

    def fresh() -> BlockManager:
        return BlockManager(args.blocks, args.block_size, hash_seed=b"bench")

    rates = {
        "allocate_free_512_tokens": best_rate(allocate_free(fresh(), args.ops), args.repeats),
        "allocate_one_more_token": best_rate(append_token(fresh(), args.ops), args.repeats),
        "lookup_prefix_hit_512_tokens": best_rate(lookup_hit(fresh(), args.ops), args.repeats),
        "commit_512_tokens": best_rate(commit(fresh(), args.ops // 4), args.repeats),
    }
    roomy = BlockManager(256 * 32, args.block_size, hash_seed=b"bench")
    step_us = min(decode_step_us(roomy, 256, 200) for _ in range(args.repeats))
    if args.json:
        print(json.dumps({"ops_per_second": rates, "decode_step_256_seqs_us": step_us}, indent=2))
        return 0
    for name, rate in rates.items():
        print(f"{name:32s} {rate:12,.0f} ops/s")
    print(f"{'decode step, 256 sequences':32s} {step_us:12,.1f} us/step")
    return 0


if __name__ == "__main__":
    sys.exit(main())
