"""Continuous batching with chunked prefill, prefix caching, preemption by recompute.

Each `schedule()` plans one step within `max_num_batched_tokens` and `max_num_seqs`. A
decode-first step (`scheduling_policy="decode-first"`, the default, vLLM's order):

    1. running decodes, oldest first (one token each)
    2. running sequences still prefilling, oldest first (a chunk each, as budget allows)
    3. waiting sequences, first come first served (prefix lookup, then a first chunk)
       until the budget, the sequence limit or the blocks run out

`scheduling_policy="prefill-first"` (SGLang's order): a step that can start or continue prompt
work (2 and 3 plan a chunk) holds only those prompt chunks, so a new request's first token does
not wait for one decode row of every running request; a step with no prompt work is the
decode-first step above. Starvation bound: prompt-only steps count the prompt tokens they
compute while some running sequence gets no chunk; once that count reaches
`max_decode_stall_tokens` (default 512), the next step is decode-first and the count
restarts. The bound is in tokens rather than steps because the decodes' wait is the prompt
work ahead of them: several short prompts (prefix-cache hits) may go ahead in a row, a long
chunked prompt alternates with the decodes. Default 512: on W3, bounds from 512 to 2048 gave
the same TTFT while the running requests' longest gap grew with the bound. Trade-off: a
running request's inter-token gap, one step under decode-first, becomes up to a run of
prompt-only steps totalling fewer than `max_decode_stall_tokens + max_num_batched_tokens`
prompt tokens (each paying its fixed cost) followed by the decode-first step; in exchange an
arriving request's TTFT no longer includes the running decodes (docs/BENCHMARKS.md, W3).

Disaggregation. Prefill role: a `Request(prefill_only=True)` is scheduled until its first
token is sampled, then waits in PREFILLED holding its blocks (not running, not counted by
`has_unfinished`); with n > 1 it forks at its final chunk like any request, and each child
parks with its own first token, all sharing the prompt blocks. The service ships the blocks
and calls `release_prefilled`. Decode role: the service allocates the prompt's slots in the
BlockManager, writes the received KV and calls `add_prefilled_request`, which joins the
request to the running batch as n decodes sharing those blocks copy on write.

The plan (`SchedulerOutput`) carries the step column-wise plus the block-table diffs the
runner's persistent batch needs: new sequences' tables once, appended block ids, and the ids
of sequences that left (`plan`).

Modules, by type: `core` (the `Scheduler`), `policy` (admission order, chunk sizes, the
preemption victim), `state` (queues, cached block tables, the step being planned), `step` (the
step's columns), `stops` (request validation, stop rules), `remote` (the decode role's
requests whose prompt KV arrives from another worker), `plan` (`SchedulerOutput`, `NewSeq`,
`ScheduledChunk`) and `config`.
Blocks are published to the prefix cache in `update()`, once their KV is computed. The
scheduler speaks policy only: integers, no tensors.
"""

from kvmesh.engine.scheduler.config import (
    ALLOCATIONS,
    POLICIES,
    SCHEDULING_POLICIES,
    SchedulerConfig,
)
from kvmesh.engine.scheduler.core import Scheduler
from kvmesh.engine.scheduler.plan import NewSeq, ScheduledChunk, SchedulerOutput, plan_of_chunks
from kvmesh.engine.scheduler.state import is_prefilled
from kvmesh.engine.scheduler.stops import stop_status, validate_request

__all__ = [
    "ALLOCATIONS",
    "POLICIES",
    "SCHEDULING_POLICIES",
    "NewSeq",
    "ScheduledChunk",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerOutput",
    "is_prefilled",
    "plan_of_chunks",
    "stop_status",
    "validate_request",
]
