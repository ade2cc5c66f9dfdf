"""Admission: waiting sequences join the batch first come first served.

A waiting sequence gets a prefix-cache lookup, then a first chunk; admission stops at the
first sequence that does not fit (budget, seats or blocks), so nobody overtakes, and it never
preempts. Baselines: `policy="static"` admits a whole batch only when nothing runs;
`allocation="contiguous"` reserves prompt + max_tokens (or max_model_len) at admission.
"""

from __future__ import annotations

from kvmesh.engine.scheduler_state import RUNNING, SchedulerState
from kvmesh.engine.scheduler_stops import max_total_tokens
from kvmesh.engine.scheduler_types import ScheduledChunk
from kvmesh.engine.sequence import Sequence


class AdmissionMixin(SchedulerState):
    def _chunk_size(self, seq: Sequence, budget: int) -> int:
        """Tokens of `seq` to compute this step: 0 when it must wait for a larger budget."""
        remaining = seq.num_tokens - seq.num_computed_tokens
        config = self.config
        if not config.enable_chunked_prefill:
            return remaining if remaining <= budget else 0
        threshold = config.long_prefill_token_threshold
        if threshold is not None and remaining > threshold:
            remaining = threshold
        return remaining if remaining <= budget else budget

    def _admit_waiting(self, budget: int, prefills: list[ScheduledChunk]) -> int:
        """Admit waiting sequences FCFS while budget, seats and blocks allow; budget left."""
        waiting = self._waiting
        max_seqs = self.config.max_num_seqs
        while waiting and budget > 0 and len(self._running) < max_seqs:
            seq = waiting[0]
            size = self._start(seq, budget)
            if not size:
                break
            waiting.popleft()
            seq.status = RUNNING
            self._running.append(seq)
            prefills.append(self._make_chunk(seq, seq.num_computed_tokens, size, None))
            budget -= size
        return budget

    def _start(self, seq: Sequence, budget: int) -> int:
        """Look up the prefix and allocate a first chunk; its size, or 0 (nothing held)."""
        self._lookup(seq)
        size = self._chunk_size(seq, budget)
        target = seq.num_computed_tokens + size
        if self.config.allocation == "contiguous":
            target = self._reservation(seq)
        if size and self.block_manager.allocate(seq.seq_id, target) is not None:
            return size
        self.block_manager.free(seq.seq_id)
        seq.num_computed_tokens = 0
        return 0

    def _lookup(self, seq: Sequence) -> None:
        bm = self.block_manager
        cached = 0
        if self.config.enable_prefix_caching:
            cached = bm.lookup_prefix(seq.seq_id, seq.all_token_ids, seq.extra_key)
        else:
            bm.allocate(seq.seq_id, 0)
        seq.num_computed_tokens = cached
        if not seq.num_preemptions:
            seq.num_cached_tokens = cached

    def _reservation(self, seq: Sequence) -> int:
        return max_total_tokens(seq.params, seq.num_prompt_tokens, self.config.max_model_len)

    def _enroll_static_batch(self) -> None:
        """Static batching: admit a whole batch (prompt blocks allocated) when nothing runs."""
        bm, waiting = self.block_manager, self._waiting
        while waiting and len(self._running) < self.config.max_num_seqs:
            seq = waiting[0]
            self._lookup(seq)
            target = seq.num_tokens
            if self.config.allocation == "contiguous":
                target = self._reservation(seq)
            if bm.allocate(seq.seq_id, target) is None:
                bm.free(seq.seq_id)
                seq.num_computed_tokens = 0
                break
            waiting.popleft()
            seq.status = RUNNING
            self._running.append(seq)
