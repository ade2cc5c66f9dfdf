"""Preemption by recompute: when a running sequence cannot get a block, free someone's.

The victim is the newest running sequence not yet planned this step (the requester itself as
the last resort). Its blocks are freed, `num_computed_tokens` goes back to 0 and it waits at
the FRONT of the waiting queue (several victims keep their age order); readmitted, it
recomputes prompt + output so far as one prefill and samples its next token from it.
"""

from __future__ import annotations

from kvmesh.engine.scheduler_state import WAITING, SchedulerState
from kvmesh.engine.scheduler_types import ScheduledChunk
from kvmesh.engine.sequence import Sequence


class PreemptionMixin(SchedulerState):
    def _plan_running(self, seq: Sequence, size: int) -> ScheduledChunk | None:
        """Chunk of `size` tokens for a running sequence, preempting others for blocks."""
        start = seq.num_computed_tokens
        while True:
            result = self.block_manager.allocate(seq.seq_id, start + size)
            if result is not None:
                return self._make_chunk(seq, start, size, result)
            victim = self._newest_unplanned(seq)
            self._preempt(victim)
            if victim is seq:
                return None

    def _newest_unplanned(self, seq: Sequence) -> Sequence:
        planned = self._sync_planned()
        for other in reversed(self._running):
            if other is not seq and other.seq_id not in planned:
                return other
        return seq

    def _preempt(self, seq: Sequence) -> None:
        """Recompute later: free blocks, restart from token 0, front of the waiting queue."""
        self.block_manager.free(seq.seq_id)
        self._tables.pop(seq.seq_id, None)
        self._running.remove(seq)
        seq.status = WAITING
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self._waiting.appendleft(seq)
        self._preempted.append(seq.seq_id)
