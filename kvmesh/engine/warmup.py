"""Warm an engine up before it serves: load (building once) the CPU kernels, run one step.

A worker calls `warm_up` before it reports ready, so no request pays for a first use: the
fused CPU kernel library is compiled on the first start with a fresh cache (seconds to a
minute, `kvmesh_kernels.cpu_build`), and the first forward pass sets up what torch and oneDNN
(or Triton, on CUDA) create lazily. The step is a prompt chunk and then one decode token in the
first KV block(s) of a pool nobody uses yet: no scheduler, block manager or prefix cache state
changes, and a block's contents are overwritten when it is first allocated.

`KVMESH_WARMUP` chooses what runs: `full` (default), `kernels` (no step) or `off`; only
`kvmesh bench cold-start` sets it, to measure what each part saves.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

from kvmesh.engine.engine import LLMEngine
from kvmesh.engine.scheduler.plan import NewSeq, ScheduledChunk, plan_of_chunks

WARMUP_TOKENS = 8  # the prompt chunk and the decode token together
WARMUP_ENV = "KVMESH_WARMUP"
MODES = ("full", "kernels", "off")
WARMUP_ID = "warmup"


@dataclass(frozen=True)
class WarmupReport:
    """What `warm_up` did: its mode, the CPU kernels' state ("loaded", "disabled",
    "unavailable", "not used" off CPU, "not loaded" when off) and each part's seconds."""

    mode: str
    kernels: str
    kernel_seconds: float
    step_seconds: float

    def as_dict(self) -> dict[str, object]:
        return {
            "mode": self.mode,
            "kernels": self.kernels,
            "kernel_seconds": round(self.kernel_seconds, 3),
            "step_seconds": round(self.step_seconds, 3),
        }


def warm_up(engine: LLMEngine, mode: str | None = None) -> WarmupReport:
    """Load the kernels and run one prompt chunk and one decode step. Call it before the
    engine serves (it writes the first KV blocks, which must be unused). `mode` defaults to
    `$KVMESH_WARMUP` or "full" (ValueError naming the variable when it is not in MODES)."""
    mode = mode or os.environ.get(WARMUP_ENV, "full")
    if mode not in MODES:
        raise ValueError(f"{WARMUP_ENV}={mode!r}: must be one of {', '.join(MODES)}")
    started = time.monotonic()
    kernels = load_kernels(engine.runner.device.type) if mode != "off" else "not loaded"
    loaded = time.monotonic()
    if mode == "full":
        run_step(engine)
    return WarmupReport(mode, kernels, loaded - started, time.monotonic() - loaded)


def load_kernels(device_type: str) -> str:
    """Build (once per cache key) and load the fused CPU kernels when the engine runs on CPU."""
    if device_type != "cpu":
        return "not used"
    from kvmesh_kernels import cpu_build

    return cpu_build.status()


def run_step(engine: LLMEngine) -> None:
    """A prompt chunk at positions 0.. and one decode token after it, in the first blocks; the
    runner then forgets the warm-up sequence. Never longer than a sequence may be
    (`max_model_len`, within the model's positions) nor than the pool."""
    runner = engine.runner
    block_size = runner.block_size
    longest = engine.scheduler.config.max_model_len
    total = min(WARMUP_TOKENS, block_size * runner.num_blocks, longest)
    ids = tuple(i % runner.vocab_size for i in range(total))
    table = tuple(range(-(-total // block_size)))
    prompt = max(1, total - 1)
    sample = (WARMUP_ID,)
    steps = [ScheduledChunk(WARMUP_ID, ids[:prompt], 0, table, (), sample)]
    if total > prompt:
        steps.append(ScheduledChunk(WARMUP_ID, ids[prompt:], prompt, table, (), sample))
    new_seqs: tuple[NewSeq, ...] = (NewSeq(WARMUP_ID, table),)
    for chunk in steps:
        runner.execute(plan_of_chunks((chunk,), block_size=block_size, new_seqs=new_seqs))
        new_seqs = ()
    runner.batch.remove((WARMUP_ID,))
