"""Shared helpers for the scheduler tests: a real BlockManager and a fake model step."""

from __future__ import annotations

import zlib
from typing import Any

from kvmesh.engine.sampling_params import SamplingParams
from kvmesh.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from kvmesh.engine.sequence import Request, Sequence
from kvmesh.memory import BlockManager

BLOCK_SIZE = 4
EOS = 2


def params(**fields: Any) -> SamplingParams:
    fields.setdefault("max_tokens", 8)
    fields.setdefault("ignore_eos", True)
    return SamplingParams(**fields)


def make_scheduler(
    num_blocks: int = 64, block_size: int = BLOCK_SIZE, **config: Any
) -> tuple[Scheduler, BlockManager]:
    config.setdefault("max_model_len", 256)
    config.setdefault("eos_token_ids", (EOS,))
    bm = BlockManager(num_blocks, block_size, hash_seed=b"test")
    return Scheduler(SchedulerConfig(**config), bm), bm


def request(
    request_id: str, prompt: list[int] | int, *, prefill_only: bool = False, **sampling: Any
) -> Request:
    """A request; an int prompt means that many consecutive tokens unique to the request."""
    if isinstance(prompt, int):
        base = 1000 * (1 + zlib.crc32(request_id.encode()) % 100_000)
        prompt = list(range(base, base + prompt))
    return Request.from_prompt(
        request_id, prompt, params(**sampling), arrival_time=0.0, prefill_only=prefill_only
    )


def fake_tokens(output: SchedulerOutput, token: int | dict[str, int] = 7) -> dict[str, int]:
    """One sampled token for every sequence the plan samples."""
    sampled = {}
    for chunk in output.chunks:
        for seq_id in chunk.sample_seq_ids:
            sampled[seq_id] = token if isinstance(token, int) else token.get(seq_id, 7)
    return sampled


def step(
    sched: Scheduler, token: int | dict[str, int] = 7
) -> tuple[SchedulerOutput, list[Sequence]]:
    """schedule() then update() with fake sampled tokens."""
    output = sched.schedule()
    return output, sched.update(output, fake_tokens(output, token))


def run_to_completion(sched: Scheduler, max_steps: int = 10_000) -> int:
    for steps in range(max_steps):
        if not sched.has_unfinished():
            return steps
        step(sched)
    raise AssertionError("scheduler did not finish")


def sizes(output: SchedulerOutput) -> dict[str, int]:
    return {chunk.seq_id: len(chunk.token_ids) for chunk in output.chunks}


class TableMirror:
    """The runner's view of the block tables, rebuilt from nothing but the plans' diffs."""

    def __init__(self) -> None:
        self.tables: dict[str, tuple[int, ...]] = {}

    def apply(self, output: SchedulerOutput) -> None:
        for seq_id in output.finished_seq_ids:
            del self.tables[seq_id]
        for seq_id, table in output.new_seqs:
            self.tables[seq_id] = table
        for seq_id, added in output.new_block_ids:
            self.tables[seq_id] += added
        for seq_id, table in zip(output.seq_ids, output.block_tables, strict=True):
            assert self.tables[seq_id] == table, seq_id
