"""One engine step's model forward, replayed: the host cost of a step at a batch size.

Builds the engine (native executor), runs `--batch` requests until a decode-only step of that
many rows comes, keeps that step's inputs (token ids, positions, the ForwardContext with its
AttentionPlan), then runs the step `--repeats` times each way, alternating: the model's eager
forward (the kernels called one by one from Python) and, where the model has one, the CPU
step program's replay of the same calls (`decode_program`); prints one JSON line with min,
p25 and median milliseconds of each and the medians' ratio. The replay writes the same K/V
slots again and attends over the same context, so every call does the step's full work; at
batch 1 on a small model the forward is the weights' read plus the per-layer host work, which
is what changes when the layers' Python changes. Compare code versions by alternating runs.

Run: `.venv/bin/python bench/step_forward.py --model DIR --dtype bfloat16 [--batch 1]
[--repeats 300] [--threads 2]`
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from typing import Any

from kvmesh.cli.main import apply_omp_defaults

apply_omp_defaults()  # before torch loads OpenMP, as every kvmesh command

import torch  # noqa: E402
from kvmesh_kernels.cpu_build import machine  # noqa: E402

from kvmesh.cli.bench_throughput import WARMUP_PROMPT, run_all_at_once  # noqa: E402
from kvmesh.engine.config import EngineConfig  # noqa: E402
from kvmesh.engine.engine import LLMEngine  # noqa: E402
from kvmesh.engine.native.llama import NativeCausalLM  # noqa: E402


def captured_step(engine: LLMEngine, batch: int) -> tuple[Any, ...]:
    """(model, input ids, positions, context) of the first decode-only step of `batch` rows."""
    kept: list[tuple[Any, ...]] = []
    forward = NativeCausalLM.forward

    def keep(model: NativeCausalLM, ids: torch.Tensor, positions: torch.Tensor, ctx: Any) -> Any:
        if not kept and ids.shape[0] == batch and ctx.num_paged_tokens == batch:
            kept.append((model, ids, positions, ctx))
        return forward(model, ids, positions, ctx)

    NativeCausalLM.forward = keep  # type: ignore[method-assign]
    try:
        prompts = [(list(range(100 + i, 300 + i)), 8) for i in range(batch)]
        run_all_at_once(engine, prompts)
    finally:
        NativeCausalLM.forward = forward  # type: ignore[method-assign]
    assert kept, f"no decode-only step of {batch} rows"
    return kept[0]


def timings(times: list[float]) -> dict[str, float]:
    """min, p25 and median of `times` (ms)."""
    times = sorted(times)
    return {
        "min_ms": round(times[0], 3),
        "p25_ms": round(times[len(times) // 4], 3),
        "median_ms": round(times[len(times) // 2], 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=300)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    config = EngineConfig(
        model=args.model,
        dtype=args.dtype,
        num_threads=args.threads,
        executor="native",
        decode_program=False,  # captured from the eager forward; the program is enabled below
    )
    engine = LLMEngine(config)
    run_all_at_once(engine, [WARMUP_PROMPT])
    model, ids, positions, ctx = captured_step(engine, args.batch)
    runner = engine.runner
    why_not = runner.enable_decode_program(args.batch)
    ways: dict[str, Callable[[], Any]] = {"eager": lambda: model.forward(ids, positions, ctx)}
    program = runner.decode_program
    if program is not None:
        ways["program"] = lambda: program.forward(ids, positions, ctx)
    times: dict[str, list[float]] = {name: [] for name in ways}
    with torch.inference_mode():
        for run in ways.values():
            for _ in range(20):
                run()
        for _ in range(args.repeats):
            for name, run in ways.items():
                start = time.perf_counter()
                run()
                times[name].append((time.perf_counter() - start) * 1e3)
    report: dict[str, Any] = {
        "machine": machine(),
        "dtype": args.dtype,
        "batch": args.batch,
        **{name: timings(values) for name, values in times.items()},
    }
    if program is None:
        report["program"] = f"not applicable: {why_not}"
    else:
        report["program_over_eager"] = round(
            report["program"]["median_ms"] / report["eager"]["median_ms"], 3
        )
    print(json.dumps(report))


if __name__ == "__main__":
    main()
