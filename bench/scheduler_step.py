"""Scheduler + block manager cost per decode step with the model stubbed out (fake sampled
tokens): mean / p50 / p99 microseconds per step at 32, 128 and 256 running sequences.
Same measurement as `kvmesh bench scheduler`.

    .venv/bin/python bench/scheduler_step.py [--batch 32 128 256] [--steps 500] [--json]

Side by side with another version of the code (a checkout of another commit, for example
`git worktree add ../kvmesh-before COMMIT`): the same measurement runs on both packages in
alternating subprocesses, and the medians over the rounds are printed.

    .venv/bin/python bench/scheduler_step.py --against ../kvmesh-before [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

from kvmesh.cli.bench_scheduler import add_arguments, run_bench_scheduler

REPO = Path(__file__).resolve().parents[1]
BENCH_MODULE = REPO / "kvmesh" / "cli" / "bench_scheduler.py"
KEYS = ("cpu_mean_us", "cpu_p50_us", "cpu_p99_us", "p50_us")

# Runs this tree's `measure` against the kvmesh package found first on sys.path.
_CHILD = """
import importlib.util, json, sys
sys.path.insert(0, {tree!r})
spec = importlib.util.spec_from_file_location("bench_under_test", {bench!r})
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
rows = [module.measure(b, {steps}, {block_size}, {caching}, {seed}) for b in {batches!r}]
print(json.dumps(rows))
"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    parser.add_argument("--against", metavar="DIR", help="also measure the kvmesh in DIR")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds (--against)")
    args = parser.parse_args(argv)
    if args.against is None:
        return run_bench_scheduler(args)
    return compare(args)


def compare(args: argparse.Namespace) -> int:
    """Median per-step cost of both trees, measured in alternating subprocesses."""
    trees = {"this": REPO, "against": Path(args.against).resolve()}
    runs: dict[str, list[list[dict[str, float]]]] = {name: [] for name in trees}
    for _ in range(args.rounds):
        for name, tree in trees.items():
            code = _CHILD.format(
                tree=str(tree),
                bench=str(BENCH_MODULE),
                steps=args.steps,
                block_size=args.block_size,
                caching=not args.no_prefix_caching,
                seed=args.seed,
                batches=list(args.batch),
            )
            done = subprocess.run(
                [sys.executable, "-c", code], cwd=tree, capture_output=True, text=True, check=True
            )
            runs[name].append(json.loads(done.stdout))
    rows = []
    for name in trees:
        for index, batch in enumerate(args.batch):
            samples = [run[index] for run in runs[name]]
            row: dict[str, float | str] = {"code": name, "running": batch}
            row.update({key: statistics.median(s[key] for s in samples) for key in KEYS})
            rows.append(row)
    if args.json:
        print(json.dumps({"rounds": args.rounds, "against": str(args.against), "results": rows}))
        return 0
    print("code     running  cpu mean us  cpu p50 us  cpu p99 us  wall p50 us")
    for row in rows:
        values = "".join(f"{row[key]:12.0f}" for key in KEYS)
        print(f"{row['code']:<8} {row['running']:>7} {values}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
