"""`kvmesh bench scheduler`: scheduler + block manager cost per decode step, model stubbed out.

For each batch size, that many requests are prefilled, then every step times `schedule()` plus
`update()` with fake sampled tokens (the stub's own work is not timed). With `--with-runner`
the runner's host side is timed too: `ModelRunner.prepare` (the plan's table diffs applied to
the persistent batch, the flat inputs, the step's validated AttentionPlan) on the tiny test
model's cache, without the forward pass; the runner sees every plan from the first.
Goal: <= 500 us per step at 256 running sequences, scheduler and runner.
Wall time includes the OS descheduling the process on a busy
machine (the p99 tail); thread CPU time (`cpu_*_us`) is the scheduler's own work.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import time
from itertools import chain
from typing import Any

DEFAULT_BATCHES = (32, 128, 256)
GOAL_US = 500.0


def register(subparsers: Any) -> None:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "scheduler", help="scheduler + block manager cost per decode step (model stubbed)"
    )
    add_arguments(parser)
    parser.set_defaults(func=run_bench_scheduler)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--batch", type=int, nargs="+", default=list(DEFAULT_BATCHES), help="running sequences"
    )
    parser.add_argument("--steps", type=int, default=500, help="timed decode steps per batch")
    parser.add_argument("--block-size", type=int, default=16, help="KV block size in tokens")
    parser.add_argument("--no-prefix-caching", action="store_true", help="skip lookup/commit")
    parser.add_argument("--seed", type=int, default=0, help="random seed of the prompts")
    parser.add_argument(
        "--scheduling-policy", choices=("decode-first", "prefill-first"), default="decode-first"
    )
    parser.add_argument(
        "--with-runner",
        action="store_true",
        help="also time the runner's input building (ModelRunner.prepare, no forward pass)",
    )
    parser.add_argument("--json", action="store_true", help="print results as JSON")


def measure(
    num_seqs: int,
    steps: int,
    block_size: int = 16,
    prefix_caching: bool = True,
    seed: int = 0,
    scheduling_policy: str = "decode-first",
    with_runner: bool = False,
) -> dict[str, float]:
    """Per-step microseconds (mean, p50, p99) of schedule + update with `num_seqs` decoding."""
    from kvmesh.engine.sampling_params import SamplingParams
    from kvmesh.engine.scheduler import Scheduler, SchedulerConfig
    from kvmesh.engine.sequence import Request
    from kvmesh.memory import BlockManager

    rng = random.Random(seed)
    max_len = 512 + steps + 1024  # room for tokens generated while others prefill
    blocks_per_seq = -(-max_len // block_size) + 1
    bm = BlockManager(num_seqs * blocks_per_seq, block_size, hash_seed=b"bench")
    # the policy is passed only when it is not the default, so that `bench/scheduler_step.py
    # --against` still runs this measurement on trees older than the option
    policy: dict[str, Any] = {}
    if scheduling_policy != "decode-first":
        policy["scheduling_policy"] = scheduling_policy
    config = SchedulerConfig(
        max_model_len=max_len,
        max_num_seqs=max(256, num_seqs),
        enable_prefix_caching=prefix_caching,
        **policy,
    )
    sched = Scheduler(config, bm)
    params = SamplingParams(max_tokens=max_len - 512, ignore_eos=True)
    for index in range(num_seqs):
        prompt = [rng.randrange(10, 31990) for _ in range(rng.randint(32, 512))]
        sched.add_request(Request.from_prompt(f"r{index}", prompt, params))
    runner = (
        _host_runner(bm.num_blocks, block_size, -(-max_len // block_size)) if with_runner else None
    )
    _until_all_decode(sched, num_seqs, runner)
    samples, cpu, runner_cpu = _timed_steps(sched, steps, num_seqs, runner)
    bm.check_integrity()
    samples.sort()
    cpu.sort()
    extra = {}
    if runner is not None:
        runner_cpu.sort()
        total = sorted(a + b for a, b in zip(cpu, runner_cpu, strict=True))
        extra = {
            "runner_cpu_mean_us": sum(runner_cpu) / len(runner_cpu),
            "runner_cpu_p50_us": _percentile(runner_cpu, 0.5),
            "total_cpu_mean_us": sum(total) / len(total),
        }
    return extra | {
        "running": num_seqs,
        "steps": steps,
        "mean_us": sum(samples) / len(samples),
        "p50_us": _percentile(samples, 0.5),
        "p99_us": _percentile(samples, 0.99),
        "cpu_mean_us": sum(cpu) / len(cpu),
        "cpu_p50_us": _percentile(cpu, 0.5),
        "cpu_p99_us": _percentile(cpu, 0.99),
    }


def _percentile(ordered: list[float], fraction: float) -> float:
    return ordered[min(len(ordered) - 1, int(len(ordered) * fraction))]


def _fake_sampled(output: Any) -> dict[str, int]:
    return dict.fromkeys(chain.from_iterable(output.sample_groups()), 11)


def _until_all_decode(sched: Any, num_seqs: int, runner: Any) -> None:
    """Step until every sequence decodes; the runner (if any) sees every plan, untimed."""
    while True:
        output = sched.schedule()
        if runner is not None:
            runner.prepare(output)
        sched.update(output, _fake_sampled(output))
        all_decode = output.num_decodes == len(output.seq_ids) == num_seqs
        if not sched.num_waiting and all_decode:
            return


def _host_runner(num_blocks: int, block_size: int, max_blocks: int) -> Any:
    """A ModelRunner over the tiny test model with a pool of `num_blocks` (prepare only)."""
    from kvmesh.engine.config import EngineConfig
    from kvmesh.engine.loader import load_model
    from kvmesh.engine.runner import ModelRunner
    from kvmesh.models.tiny import tiny_model_path

    loaded = load_model(EngineConfig(model=str(tiny_model_path()), dtype="float32"))
    return ModelRunner(loaded, num_blocks, block_size, "auto", max_blocks)


def _timed_steps(
    sched: Any, steps: int, num_seqs: int, runner: Any = None
) -> tuple[list[float], list[float], list[float]]:
    """Wall and thread-CPU microseconds of schedule() + update() per step (stub excluded), and
    the thread-CPU microseconds of `runner.prepare` when a runner is given."""
    wall, cpu, runner_cpu = [], [], []
    clock, cpu_clock = time.perf_counter_ns, time.thread_time_ns
    gc_was_enabled = gc.isenabled()
    gc.disable()  # collections are the interpreter's cost, not the scheduler's
    try:
        for _ in range(steps):
            cpu_start, start = cpu_clock(), clock()
            output = sched.schedule()
            planned, cpu_planned = clock(), cpu_clock()
            if runner is not None:
                runner.prepare(output)
                runner_cpu.append((cpu_clock() - cpu_planned) / 1000.0)
            sampled = _fake_sampled(output)
            cpu_resumed, resumed = cpu_clock(), clock()
            sched.update(output, sampled)
            end, cpu_end = clock(), cpu_clock()
            assert len(output.seq_ids) == num_seqs
            wall.append((planned - start + end - resumed) / 1000.0)
            cpu.append((cpu_planned - cpu_start + cpu_end - cpu_resumed) / 1000.0)
    finally:
        if gc_was_enabled:
            gc.enable()
    return wall, cpu, runner_cpu


def run_bench_scheduler(args: argparse.Namespace) -> int:
    """Print a table (or JSON) of per-step cost for each batch size."""
    results = [
        measure(
            batch,
            args.steps,
            args.block_size,
            not args.no_prefix_caching,
            args.seed,
            args.scheduling_policy,
            args.with_runner,
        )
        for batch in args.batch
    ]
    if args.json:
        print(json.dumps({"goal_us": GOAL_US, "results": results}, indent=2))
        return 0
    from rich.console import Console
    from rich.table import Table

    caching = "off" if args.no_prefix_caching else "on"
    title = f"block {args.block_size}, prefix caching {caching}, {args.scheduling_policy}"
    table = Table(title=f"scheduler step cost ({title})")
    keys: tuple[str, ...] = (
        "mean_us",
        "p50_us",
        "p99_us",
        "cpu_mean_us",
        "cpu_p50_us",
        "cpu_p99_us",
    )
    labels: tuple[str, ...] = (
        "mean us",
        "p50 us",
        "p99 us",
        "cpu mean us",
        "cpu p50 us",
        "cpu p99 us",
    )
    if args.with_runner:
        keys += ("runner_cpu_mean_us", "total_cpu_mean_us")
        labels += ("runner cpu mean us", "total cpu mean us")
    for label in ("running", *labels, f"goal {GOAL_US:.0f} us"):
        table.add_column(label, justify="right")
    for row in results:
        cost = row.get("total_cpu_mean_us", row["cpu_mean_us"])
        verdict = "ok" if cost <= GOAL_US else "over"
        table.add_row(str(row["running"]), *(f"{row[key]:.1f}" for key in keys), verdict)
    Console().print(table)
    return 0
