"""Liveness under KV pressure: two completions of one request (n=2) that do not both fit the
pool must not keep preempting each other. Under prefill-first without prefix caching, the
recomputing child's prompt-only chunks preempted its older sibling (unplanned in a prompt-only
step), which then recomputed and preempted it back: ~one token per whole recompute, so steps
grew quadratically with the output length (791 steps here). Prompt work never evicts a decode
now. Bounded: at most MAX_STEPS engine steps."""

from __future__ import annotations

import pytest

from kvmesh import LLM, SamplingParams
from kvmesh.models.tiny import tiny_model_path

MAX_STEPS = 2000


@pytest.mark.parametrize("policy", ["decode-first", "prefill-first"])
def test_forked_children_do_not_ping_pong(policy: str) -> None:
    llm = LLM(
        str(tiny_model_path()),
        num_kv_blocks=14,  # 224 tokens: one 46 + 160 completion, not two
        max_model_len=512,
        max_num_batched_tokens=32,
        scheduling_policy=policy,
        enable_prefix_caching=False,
        num_threads=1,
    )
    engine = llm.engine
    params = SamplingParams(temperature=1.0, seed=1, n=2, max_tokens=160, ignore_eos=True)
    engine.add_request("r", list(range(10, 56)), params)
    steps = 0
    while engine.has_unfinished() and steps < MAX_STEPS:
        engine.step()
        steps += 1
    assert not engine.has_unfinished()
    # serial bound: one child's prompt + 160 decodes, the other's 206-token recompute + 160
    assert steps <= 400, (steps, engine.scheduler.num_preemptions)
