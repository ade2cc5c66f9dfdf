"""Where a W1 run's time goes on the native executor: timers around its parts.

Runs W1 once on the engine (after a warm-up prompt) with wall-clock timers around the paged
attention call (split into decode-only steps and steps with prompt tokens), the linears
(packed or plain; with kvmesh's GEMM the gate|up linear includes SiLU-and-mul, its epilogue),
SiLU-and-mul where it is a call of its own, the residual add + RMSNorm calls and the sampler
(the logits' argmax or draw), and prints one JSON line: seconds per part, the run's seconds
and tok/s, and `other` (rotary, embedding, Python and the host side). The timers wrap
module-level calls, so they add a few microseconds per call, and decode steps run call by call
(`decode_program` off: the recorded program's replay makes these calls from C, past the
timers); compare runs of this script with each other, not with `kvmesh bench throughput`.

Run: `.venv/bin/python bench/w1_breakdown.py --model DIR --dtype float32 [--threads 2]
[--fresh-attention auto|on|off] [--silu-epilogue on|off]`
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

from kvmesh.cli.main import apply_omp_defaults

apply_omp_defaults()  # before torch loads OpenMP, as every kvmesh command

from kvmesh_kernels import cpu_gemm  # noqa: E402

from kvmesh.cli.bench_throughput import WARMUP_PROMPT, run_all_at_once, w1_requests  # noqa: E402
from kvmesh.engine import cpu_linear  # noqa: E402
from kvmesh.engine.config import CPU_GEMMS, FRESH_ATTENTION_MODES, EngineConfig  # noqa: E402
from kvmesh.engine.engine import LLMEngine  # noqa: E402
from kvmesh.engine.native import layers, llama  # noqa: E402
from kvmesh.engine.sampler import Sampler  # noqa: E402

SECONDS: defaultdict[str, float] = defaultdict(float)


def timed(owner: Any, name: str, part: Callable[..., str] | str) -> None:
    """Replace owner.name by a wrapper that adds its wall time to SECONDS[part] (part may be a
    function of the call's arguments)."""
    inner = getattr(owner, name)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        result = inner(*args, **kwargs)
        key = part(*args) if callable(part) else part
        SECONDS[key] += time.perf_counter() - start
        return result

    setattr(owner, name, wrapper)


def attention_part(ctx: Any, *_: Any) -> str:
    """Decode-only steps (every sequence one token) or steps that carry prompt tokens."""
    decode_only = ctx.num_paged_tokens == ctx.num_paged_seqs and not ctx.fresh_bounds
    return "attention_decode_steps" if decode_only else "attention_prompt_steps"


def linears_part(_: Any, x: Any) -> str:
    """Linears on up to 64 rows (decode-sized: weights streamed per call) or more (prompts)."""
    return "linears_up_to_64_rows" if x.shape[0] <= 64 else "linears_over_64_rows"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--fresh-attention", default="auto", choices=FRESH_ATTENTION_MODES)
    parser.add_argument("--cpu-gemm", default="auto", choices=CPU_GEMMS)
    parser.add_argument(
        "--silu-epilogue",
        default="on",
        choices=("on", "off"),
        help="off: gate|up as a plain GEMM, then the SiLU-and-mul kernel (the A/B baseline)",
    )
    args = parser.parse_args()
    if args.silu_epilogue == "off":
        cpu_gemm.gate_up_fits = lambda weight: False  # type: ignore[assignment]
    # The layers hold their linears' bound kernels from build time: wrap before building.
    timed(cpu_linear.CpuGemmLinear, "run", linears_part)
    timed(cpu_linear.CpuGemmGateUpSilu, "run", linears_part)  # with SiLU-and-mul in it
    timed(cpu_linear.PackedLinear, "run", linears_part)
    timed(layers.PlainLinear, "forward", linears_part)
    engine = LLMEngine(
        EngineConfig(
            model=args.model,
            dtype=args.dtype,
            num_threads=args.threads,
            executor="native",
            fresh_attention=args.fresh_attention,
            cpu_gemm=args.cpu_gemm,
            decode_program=False,  # the timers wrap the Python-level calls
        )
    )
    run_all_at_once(engine, [WARMUP_PROMPT])
    SECONDS.clear()  # the load's probes and the warm-up
    timed(llama, "attend", attention_part)
    timed(llama, "silu_and_mul", "silu_and_mul")
    timed(layers.RMSNorm, "add_forward", "add_rms_norm")
    timed(Sampler, "__call__", "sampling")
    generated, seconds, _ = run_all_at_once(engine, w1_requests(engine.runner.vocab_size))
    parts = {key: round(value, 2) for key, value in sorted(SECONDS.items())}
    other = seconds - sum(SECONDS.values())
    report = {
        "dtype": args.dtype,
        "fresh_rule": engine.runner.fresh_rule.describe(),
        "linears": engine.runner.loaded.linears,
        "silu_epilogue": args.silu_epilogue,
        "seconds": round(seconds, 2),
        "tok_per_s": round(generated / seconds, 1),
    }
    print(json.dumps({**report, **parts, "other": round(other, 2)}))


if __name__ == "__main__":
    main()
