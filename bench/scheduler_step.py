"""Scheduler + block manager cost per decode step with the model stubbed out (fake sampled
tokens): mean / p50 / p99 microseconds per step at 32, 128 and 256 running sequences.
Same measurement as `kvmesh bench scheduler`.

    .venv/bin/python bench/scheduler_step.py [--batch 32 128 256] [--steps 500] [--json]
"""

from __future__ import annotations

import argparse
import sys

from kvmesh.cli.bench_scheduler import add_arguments, run_bench_scheduler


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run_bench_scheduler(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
