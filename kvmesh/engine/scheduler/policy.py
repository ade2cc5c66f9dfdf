"""Admission order, chunk sizes and the preemption victim: the policies `schedule()` applies.

Admission: waiting sequences join the batch first come first served. A waiting sequence gets
a prefix-cache lookup, then a first chunk; admission stops at the first sequence that does not
fit (budget, seats or blocks), so nobody overtakes, and it never preempts. Baselines:
`policy="static"` admits a whole batch only when nothing runs; `allocation="contiguous"`
reserves at admission every slot the sequence can write (`stops.max_kv_slots`: prompt +
max_tokens, or max_model_len, less the last sampled token, whose KV is never written).

Preemption by recompute: the victim is the newest running sequence not yet planned this step
(the requester itself as the last resort). Its blocks are freed, `num_computed_tokens` goes
back to 0 and it waits at the FRONT of the waiting queue (several victims keep their age
order); readmitted, it recomputes prompt + output so far as one prefill and samples its next
token from it. Its prefix lookup then hits its own published blocks, which therefore stay
where they were in SLRU (no promotion: no other request hit them).
"""

from __future__ import annotations

from kvmesh.engine.scheduler.config import SchedulerConfig
from kvmesh.engine.scheduler.state import RUNNING, SchedulerState
from kvmesh.engine.scheduler.stops import max_kv_slots
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
    """Static batching: admit a whole batch (prompt blocks allocated) when nothing runs.

    Each sequence is admitted as `admit_waiting` admits it (a swapped-out one swapped back
    in); enrollment stops at the first that does not fit, holding nothing for it."""
    waiting = state.waiting
    while waiting and len(state.running) < config.max_num_seqs:
        seq = waiting[0]
        if not _open_table(state, config, seq):
            break
        if not _grow_table(state, config, seq, seq.num_tokens):
            _drop_table(state, seq)
            break
        waiting.popleft()
        seq.status = RUNNING
        state.running.append(seq)


def newest_unplanned(state: SchedulerState, seq: Sequence) -> Sequence:
    """The preemption victim when `seq` needs blocks (`seq` itself as the last resort): the
    newest running sequence not planned in this step. Prompt work never evicts a decode (as
    vLLM's waiting work never evicts running work): a prefill-first step plans no decodes, and
    a recomputing sequence evicting its decoding sibling, which then recomputed and evicted it
    back, gained about one token per whole recompute."""
    planned = state.sync_planned()
    prompt_work = is_prefilling(seq)
    for other in reversed(state.running):
        if other is seq or other.seq_id in planned:
            continue
        if prompt_work and not is_prefilling(other):
            continue
        return other
    return seq


def is_prefilling(seq: Sequence) -> bool:
    """Whether `seq` still has prompt (or recompute) tokens to compute, not one decode."""
    return seq.num_tokens - seq.num_computed_tokens != 1


def _start(state: SchedulerState, config: SchedulerConfig, seq: Sequence, budget: int) -> int:
    """Look up the prefix and allocate a first chunk; its size, or 0 (nothing held; a
    swapped-out sequence stays swapped out)."""
    if not _open_table(state, config, seq):
        return 0
    size = chunk_size(seq, budget, config)
    if size and _grow_table(state, config, seq, seq.num_computed_tokens + size):
        return size
    _drop_table(state, seq)
    return 0


def _open_table(state: SchedulerState, config: SchedulerConfig, seq: Sequence) -> bool:
    """Give a waiting sequence a table: a swapped-out one is swapped back in (its KV lands
    before the step; progress is kept), any other gets the prefix lookup. False (nothing
    changed: it stays swapped out) when the swap-in finds too few blocks."""
    bm = state.block_manager
    if bm.is_swapped(seq.seq_id):
        return bm.swap_in(seq.seq_id)
    _lookup(state, config, seq)
    return True


def _grow_table(
    state: SchedulerState, config: SchedulerConfig, seq: Sequence, num_tokens: int
) -> bool:
    """Cover `num_tokens` slots (`allocation="contiguous"`: the whole reservation); False
    (the table unchanged) when blocks run out."""
    if config.allocation == "contiguous":
        num_tokens = _reservation(seq, config)
    return state.block_manager.allocate(seq.seq_id, num_tokens) is not None


def _drop_table(state: SchedulerState, seq: Sequence) -> None:
    """Free the table `_open_table` gave a sequence that was not admitted after all; it
    restarts from token 0 (a swapped-in one gives up its KV)."""
    state.block_manager.free(seq.seq_id)
    seq.num_computed_tokens = 0


def _lookup(state: SchedulerState, config: SchedulerConfig, seq: Sequence) -> None:
    bm = state.block_manager
    cached = 0
    owes_prompt_logprobs = seq.params.prompt_logprobs is not None and not seq.output_ids
    if config.enable_prefix_caching and not owes_prompt_logprobs:  # those need every row
        own_blocks = bool(seq.num_preemptions)  # re-admitted: it published what it hits
        cached = bm.lookup_prefix(
            seq.seq_id, seq.all_token_ids, seq.extra_key, promote=not own_blocks
        )
    else:
        bm.allocate(seq.seq_id, 0)
    seq.num_computed_tokens = cached
    if not seq.num_preemptions:
        seq.num_cached_tokens = cached


def _reservation(seq: Sequence, config: SchedulerConfig) -> int:
    return max_kv_slots(seq.params, seq.num_prompt_tokens, config.max_model_len)
