"""Warm an engine up before it serves: load (building once) the CPU kernels, run one step.

A worker calls `warm_up` before it reports ready, so no request pays for a first use: the
fused CPU kernel library is compiled on the first start with a fresh cache (seconds to a
minute, `kvmesh_kernels.cpu_build`), and the first forward pass sets up what torch and oneDNN
(or Triton, on CUDA) create lazily. The step is a prompt chunk and then one decode token in the
first KV block(s) of a pool nobody uses yet: no scheduler, block manager or prefix cache state
changes, and a block's contents are overwritten when it is first allocated.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from kvmesh.engine.engine import LLMEngine

WARMUP_TOKENS = 8  # the prompt chunk and the decode token together


@dataclass(frozen=True)
class WarmupChunk:
    """One chunk of the warm-up step (the runner's ChunkPlan)."""

    token_ids: tuple[int, ...]
    start_pos: int
    block_table: tuple[int, ...]
    slot_mapping: tuple[int, ...]
    sample_seq_ids: tuple[str, ...] = ("warmup",)


@dataclass(frozen=True)
class WarmupStep:
    """A runner StepPlan of one chunk."""

    chunks: tuple[WarmupChunk, ...]
    copy_pairs: tuple[tuple[int, int], ...] = field(default=())


@dataclass(frozen=True)
class WarmupReport:
    """What `warm_up` did: the CPU kernels' state ("loaded", "disabled", "unavailable" or
    "not used" off CPU) and the seconds each part took."""

    kernels: str
    kernel_seconds: float
    step_seconds: float

    def as_dict(self) -> dict[str, object]:
        return {
            "kernels": self.kernels,
            "kernel_seconds": round(self.kernel_seconds, 3),
            "step_seconds": round(self.step_seconds, 3),
        }


def warm_up(engine: LLMEngine) -> WarmupReport:
    """Load the kernels and run one prompt chunk and one decode step. Call it before the
    engine serves (it writes the first KV blocks, which must be unused)."""
    started = time.monotonic()
    kernels = load_kernels(engine.runner.device.type)
    loaded = time.monotonic()
    run_step(engine)
    return WarmupReport(kernels, loaded - started, time.monotonic() - loaded)


def load_kernels(device_type: str) -> str:
    """Build (once per cache key) and load the fused CPU kernels when the engine runs on CPU."""
    if device_type != "cpu":
        return "not used"
    from kvmesh_kernels import cpu_build

    return cpu_build.status()


def run_step(engine: LLMEngine) -> None:
    """A prompt chunk at positions 0.. and one decode token after it, in the first blocks."""
    runner = engine.runner
    block_size = runner.block_size
    total = min(WARMUP_TOKENS, block_size * runner.num_blocks)
    ids = tuple(i % runner.vocab_size for i in range(total))
    slots = tuple(range(total))
    table = tuple(range(-(-total // block_size)))
    prompt = max(1, total - 1)
    steps = [WarmupChunk(ids[:prompt], 0, table, slots[:prompt])]
    if total > prompt:
        steps.append(WarmupChunk(ids[prompt:], prompt, table, slots[prompt:]))
    for chunk in steps:
        runner.execute(WarmupStep((chunk,)))
