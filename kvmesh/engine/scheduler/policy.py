"""Admission order, chunk sizes and the preemption victim: the policies `schedule()` applies.

Admission: waiting sequences join the batch first come first served. A waiting sequence gets
a prefix-cache lookup, then a first chunk; admission stops at the first sequence that does not
fit (budget, seats or blocks), so nobody overtakes, and it never preempts. Baselines:
`policy="static"` admits a whole batch only when nothing runs; `allocation="contiguous"`
reserves prompt + max_tokens (or max_model_len) at admission.

Preemption by recompute: the victim is the newest running sequence not yet planned this step
(the requester itself as the last resort). Its blocks are freed, `num_computed_tokens` goes
back to 0 and it waits at the FRONT of the waiting queue (several victims keep their age
order); readmitted, it recomputes prompt + output so far as one prefill and samples its next
token from it.
"""

from __future__ import annotations

from kvmesh.engine.scheduler.config import SchedulerConfig
from kvmesh.engine.scheduler.state import RUNNING, SchedulerState
from kvmesh.engine.scheduler.stops import max_total_tokens
from kvmesh.engine.sequence import Sequence


def chunk_size(seq: Sequence, budget: int, config: SchedulerConfig) -> int:
    """Tokens of `seq` to compute this step: 0 when it must wait for a larger budget."""
    remaining = seq.num_tokens - seq.num_computed_tokens
    if not config.enable_chunked_prefill:
        return remaining if remaining <= budget else 0
    threshold = config.long_prefill_token_threshold
    if threshold is not None and remaining > threshold:
        remaining = threshold
    return remaining if remaining <= budget else budget


def admit_waiting(state: SchedulerState, config: SchedulerConfig, budget: int) -> int:
    """Admit waiting sequences FCFS while budget, seats and blocks allow; budget left."""
    waiting = state.waiting
    max_seqs = config.max_num_seqs
    while waiting and budget > 0 and len(state.running) < max_seqs:
        seq = waiting[0]
        size = _start(state, config, seq, budget)
        if not size:
            break
        waiting.popleft()
        seq.status = RUNNING
        state.running.append(seq)
        state.make_chunk(seq, seq.num_computed_tokens, size, None)
        budget -= size
    return budget


def enroll_static_batch(state: SchedulerState, config: SchedulerConfig) -> None:
    """Static batching: admit a whole batch (prompt blocks allocated) when nothing runs."""
    bm, waiting = state.block_manager, state.waiting
    while waiting and len(state.running) < config.max_num_seqs:
        seq = waiting[0]
        _lookup(state, config, seq)
        target = seq.num_tokens
        if config.allocation == "contiguous":
            target = _reservation(seq, config)
        if bm.allocate(seq.seq_id, target) is None:
            bm.free(seq.seq_id)
            seq.num_computed_tokens = 0
            break
        waiting.popleft()
        seq.status = RUNNING
        state.running.append(seq)


def newest_unplanned(state: SchedulerState, seq: Sequence) -> Sequence:
    """The preemption victim when `seq` needs blocks (`seq` itself as the last resort)."""
    planned = state.sync_planned()
    for other in reversed(state.running):
        if other is not seq and other.seq_id not in planned:
            return other
    return seq


def _start(state: SchedulerState, config: SchedulerConfig, seq: Sequence, budget: int) -> int:
    """Look up the prefix and allocate a first chunk; its size, or 0 (nothing held; a
    swapped-out sequence stays swapped out)."""
    bm = state.block_manager
    if bm.is_swapped(seq.seq_id):
        if not bm.swap_in(seq.seq_id):  # its KV lands before the step; progress is kept
            return 0
    else:
        _lookup(state, config, seq)
    size = chunk_size(seq, budget, config)
    target = seq.num_computed_tokens + size
    if config.allocation == "contiguous":
        target = _reservation(seq, config)
    if size and state.block_manager.allocate(seq.seq_id, target) is not None:
        return size
    state.block_manager.free(seq.seq_id)
    seq.num_computed_tokens = 0
    return 0


def _lookup(state: SchedulerState, config: SchedulerConfig, seq: Sequence) -> None:
    bm = state.block_manager
    cached = 0
    owes_prompt_logprobs = seq.params.prompt_logprobs is not None and not seq.output_ids
    if config.enable_prefix_caching and not owes_prompt_logprobs:  # those need every row
        cached = bm.lookup_prefix(seq.seq_id, seq.all_token_ids, seq.extra_key)
    else:
        bm.allocate(seq.seq_id, 0)
    seq.num_computed_tokens = cached
    if not seq.num_preemptions:
        seq.num_cached_tokens = cached


def _reservation(seq: Sequence, config: SchedulerConfig) -> int:
    return max_total_tokens(seq.params, seq.num_prompt_tokens, config.max_model_len)
