"""The scheduler's state (queues, cached block tables) and the helpers every part shares.

`Scheduler` is assembled from this base and three parts: admission (`scheduler_admission`),
preemption (`scheduler_preemption`) and the disaggregation hooks (`scheduler_disagg`).

State of one live sequence:

    status      where                      blocks held
    WAITING     `_waiting` (FIFO)          none (preempted ones restart from token 0)
    RUNNING     `_running` (newest last)   its table; `_tables` caches it as a tuple
    PREFILLED   only `_seqs`               its table, until `release_prefilled` or abort
"""

from __future__ import annotations

from collections import deque

from kvmesh.engine.scheduler_stops import stop_status
from kvmesh.engine.scheduler_types import ScheduledChunk, SchedulerConfig
from kvmesh.engine.sequence import Request, Sequence, SequenceStatus, child_seq_id
from kvmesh.memory import AllocResult, BlockManager

RUNNING = SequenceStatus.RUNNING
WAITING = SequenceStatus.WAITING
PREFILLED = SequenceStatus.PREFILLED

new_chunk = tuple.__new__  # new_chunk(ScheduledChunk, fields): skips NamedTuple's Python __new__


class SchedulerState:
    """Queues and per-sequence bookkeeping; no policy of its own."""

    def __init__(self, config: SchedulerConfig, block_manager: BlockManager) -> None:
        self.config = config
        self.block_manager = block_manager
        self._bs = block_manager.block_size
        self._requests: dict[str, Request] = {}
        self._seqs: dict[str, Sequence] = {}  # live sequences (waiting, running, prefilled)
        self._waiting: deque[Sequence] = deque()
        self._running: list[Sequence] = []  # admission order: newest last
        # block tables as last planned; a table only grows, so the tuple is rebuilt only when
        # the block manager reports new blocks or a copy (dropped on fork, preempt, finish)
        self._tables: dict[str, tuple[int, ...]] = {}
        # chunks of the step being planned; decode chunks on the fast path are not added to
        # `_planned` one by one: `_sync_planned` catches up when preemption needs the set
        self._decodes: list[ScheduledChunk] = []
        self._num_synced = 0
        self._planned: set[str] = set()
        self._copy_pairs: list[tuple[int, int]] = []
        self._preempted: list[str] = []
        self.num_preemptions = 0
        # prefill-first (see `kvmesh.engine.scheduler`): prompt tokens computed in prompt-only
        # steps since the decodes last ran, its limit, and whether a running sequence may
        # still be prefilling (cleared once a step planned no prompt work and found none)
        self._prefill_first = config.scheduling_policy == "prefill-first"
        self._stall_limit = config.max_decode_stall_tokens
        self._stalled_tokens = 0
        self._maybe_prefilling = False

    def _begin_step(self) -> None:
        self._decodes = []
        self._num_synced = 0
        self._planned.clear()
        self._copy_pairs = []
        self._preempted = []

    def _sync_planned(self) -> set[str]:
        """The ids of every sequence with a chunk (or a sampled row) in the step so far."""
        decodes = self._decodes
        if self._num_synced < len(decodes):
            self._planned.update(chunk[0] for chunk in decodes[self._num_synced :])
            self._num_synced = len(decodes)
        return self._planned

    # -- chunks ------------------------------------------------------------------------------
    def _make_chunk(
        self, seq: Sequence, start: int, size: int, result: AllocResult | None
    ) -> ScheduledChunk:
        """The chunk [start, start + size) of `seq`, whose blocks are already allocated."""
        seq_id = seq.seq_id
        bm = self.block_manager
        table = self._tables.get(seq_id)
        if result is not None and result.copy_pairs:
            self._copy_pairs.extend(result.copy_pairs)
            table = None
        if table is None or result is None:
            table = self._tables[seq_id] = tuple(bm.block_table(seq_id))
        elif result.new_blocks:  # appended in table order (no copy): extend the cached tuple
            table = self._tables[seq_id] = table + tuple(result.new_blocks)
        end = start + size
        tokens = seq.all_token_ids
        if size == 1:
            bs = self._bs
            slots: tuple[int, ...] = (table[start // bs] * bs + start % bs,)
            token_ids: tuple[int, ...] = (tokens[start],)
        else:
            slots = tuple(bm.slot_mapping(seq_id, start, end))
            token_ids = tuple(tokens[start:end])
        self._planned.add(seq_id)
        sample_ids: tuple[str, ...] = ()
        if end == len(tokens):
            sample_ids = self._fork_children(seq) if seq.params.n > 1 else (seq_id,)
        return new_chunk(ScheduledChunk, (seq_id, token_ids, start, table, slots, sample_ids))

    def _fork_children(self, seq: Sequence) -> tuple[str, ...]:
        """Fork the n children of a request at its final prefill chunk (once)."""
        request = self._requests[seq.request_id]
        if len(request.seqs) > 1:
            return (seq.seq_id,)
        self._tables.pop(seq.seq_id, None)  # its last block is now shared: next write copies
        for index in range(1, seq.params.n):
            child = seq.fork(child_seq_id(seq.request_id, index))
            self.block_manager.fork(seq.seq_id, child.seq_id)
            request.seqs.append(child)
            self._seqs[child.seq_id] = child
            self._running.append(child)
            self._planned.add(child.seq_id)
        return tuple(child.seq_id for child in request.seqs)

    # -- leaving -----------------------------------------------------------------------------
    def _stop_or_park(self, seq: Sequence) -> bool:
        """After a token that may end `seq` (a stop id or its token limit): finish it, or park
        a prefill-only sequence in PREFILLED at its first token. True if it left the batch."""
        if self._apply_stop(seq):
            return True
        if len(seq.output_ids) == 1 and self._requests[seq.request_id].prefill_only:
            seq.status = PREFILLED  # holds its blocks until released
            return True
        return False

    def _apply_stop(self, seq: Sequence) -> bool:
        """Finish `seq` (freeing its blocks) if a stop rule fires; True if it finished."""
        stop = stop_status(seq, self.config.eos_token_id, self.config.max_model_len)
        if stop is None:
            return False
        self.block_manager.free(seq.seq_id)
        self._tables.pop(seq.seq_id, None)
        del self._seqs[seq.seq_id]
        seq.finish(*stop)
        self._forget_if_done(seq.request_id)
        return True

    def _drop(self, seq: Sequence) -> None:
        """Remove a live sequence from every queue and free its blocks."""
        if seq.status is RUNNING:
            self._running.remove(seq)
        elif seq.status is WAITING:
            self._waiting.remove(seq)
        if self.block_manager.has(seq.seq_id):
            self.block_manager.free(seq.seq_id)
        self._tables.pop(seq.seq_id, None)
        self._seqs.pop(seq.seq_id, None)

    def _forget_if_done(self, request_id: str) -> None:
        request = self._requests.get(request_id)
        if request is not None and request.is_finished:
            del self._requests[request_id]
