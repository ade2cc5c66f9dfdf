"""The scheduler's state: queues, cached block tables and the step being planned; no policy.

State of one live sequence:

    status      where                     blocks held
    WAITING     `waiting` (FIFO)          none (preempted ones restart from token 0)
    RUNNING     `running` (newest last)   its table; `tables` caches it as a tuple
    PREFILLED   only `seqs`               its table, until `release_prefilled` or abort

`tables` is also what the runner was told: a sequence is in it from the plan that first sends
its table until it leaves (`departed`, sent with the next non-empty plan); a None entry is a
table the runner holds but the next chunk replaces whole (a fork's shared last block, or an
n > 1 prompt before its final, forking chunk).
"""

from __future__ import annotations

from collections import deque

from kvmesh.engine.errors import InvalidParameterError
from kvmesh.engine.scheduler.config import SchedulerConfig
from kvmesh.engine.scheduler.plan import NewSeq
from kvmesh.engine.scheduler.step import StepBuilder
from kvmesh.engine.scheduler.stops import stop_status
from kvmesh.engine.sequence import Request, Sequence, SequenceStatus, child_seq_id
from kvmesh.memory import AllocResult, BlockManager
from kvmesh.memory.tiers.costs import PreemptionChooser

RUNNING = SequenceStatus.RUNNING
WAITING = SequenceStatus.WAITING
PREFILLED = SequenceStatus.PREFILLED
REMOTE_KV = SequenceStatus.WAITING_FOR_REMOTE_KV


class SchedulerState:
    """Every request and live sequence, the queues, and the chunks of the step being planned."""

    def __init__(self, block_manager: BlockManager, preemption: str = "recompute") -> None:
        self.block_manager = block_manager
        tiers = block_manager.tiers
        self.chooser = None  # swap or recompute, when there is a host tier to swap to
        if tiers is not None:
            self.chooser = PreemptionChooser(preemption, tiers.device.block_bytes, tiers.rates)
        self.block_size = block_manager.block_size
        self.requests: dict[str, Request] = {}
        self.seqs: dict[str, Sequence] = {}  # live sequences (waiting, running, prefilled)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # admission order: newest last
        # block tables as last planned; a table only grows, so the tuple is rebuilt only when
        # the block manager reports new blocks or a copy (None after a fork; dropped on
        # preempt, finish)
        self.tables: dict[str, tuple[int, ...] | None] = {}
        self.departed: list[str] = []  # left `tables` since the last non-empty plan
        # the step being planned; decodes on the fast path are not added to `planned` one by
        # one: `sync_planned` catches up when preemption needs the set
        self.step = StepBuilder()
        self.num_synced = 0
        self.planned: set[str] = set()
        self.copy_pairs: list[tuple[int, int]] = []
        self.preempted: list[str] = []

    def begin_step(self) -> None:
        self.step = StepBuilder()
        self.num_synced = 0
        self.planned.clear()
        self.copy_pairs = []
        self.preempted = []

    def sync_planned(self) -> set[str]:
        """The ids of every sequence with a chunk (or a sampled row) in the step so far."""
        decodes = self.step.decode_ids
        if self.num_synced < len(decodes):
            self.planned.update(decodes[self.num_synced :])
            self.num_synced = len(decodes)
        return self.planned

    def forget_table(self, seq_id: str) -> None:
        """Drop the cached table of a sequence leaving the batch; the runner is told."""
        if seq_id in self.tables:
            del self.tables[seq_id]
            self.departed.append(seq_id)

    # -- chunks ------------------------------------------------------------------------------
    def make_chunk(self, seq: Sequence, start: int, size: int, result: AllocResult | None) -> None:
        """Plan the chunk [start, start + size) of `seq`, whose blocks are already allocated,
        with the table diff the runner needs."""
        seq_id = seq.seq_id
        step = self.step
        table = self.tables.get(seq_id)
        if result is not None and result.copy_pairs:
            self.copy_pairs.extend(result.copy_pairs)
            table = None
        if table is None or result is None:
            table = self.tables[seq_id] = tuple(self.block_manager.block_table(seq_id))
            step.new_seqs.append(NewSeq(seq_id, table))
        elif result.new_blocks:  # appended in table order (no copy): extend the cached tuple
            added = tuple(result.new_blocks)
            table = self.tables[seq_id] = table + added
            step.new_block_ids.append((seq_id, added))
        end = start + size
        tokens = seq.all_token_ids
        self.planned.add(seq_id)
        sample_ids: tuple[str, ...] = ()
        if end == len(tokens):
            sample_ids = self.fork_children(seq) if seq.params.n > 1 else (seq_id,)
        elif seq.params.n > 1:  # its final chunk forks: keep it off the decode fast path
            self.tables[seq_id] = None
        step.add(seq_id, start, tokens[start:end], table, sample_ids)

    def fork_children(self, seq: Sequence) -> tuple[str, ...]:
        """Fork the n children of a request at its final prefill chunk (once)."""
        request = self.requests[seq.request_id]
        if len(request.seqs) > 1:
            return (seq.seq_id,)
        self.tables[seq.seq_id] = None  # its last block is now shared: next write copies
        for index in range(1, seq.params.n):
            child = seq.fork(child_seq_id(seq.request_id, index))
            self.block_manager.fork(seq.seq_id, child.seq_id)
            request.seqs.append(child)
            self.seqs[child.seq_id] = child
            self.running.append(child)
            self.planned.add(child.seq_id)
        return tuple(child.seq_id for child in request.seqs)

    def join_prefilled(
        self, request: Request, num_computed: int, num_completions: int, *, commit: bool
    ) -> None:
        """Register a request whose prompt KV is in its blocks as `num_completions` running
        decodes: the sequence (its blocks published first if `commit`), then its children,
        which share every block (ref +1)."""
        seq = request.seqs[0]
        seq.num_computed_tokens = num_computed
        seq.status = RUNNING
        self.requests[request.request_id] = request
        self.seqs[seq.seq_id] = seq
        self.running.append(seq)
        if commit:
            self.block_manager.commit(seq.seq_id, seq.all_token_ids, num_computed, seq.extra_key)
        for index in range(1, num_completions):
            child = seq.fork(child_seq_id(request.request_id, index))
            self.block_manager.fork(seq.seq_id, child.seq_id)
            request.seqs.append(child)
            self.seqs[child.seq_id] = child
            self.running.append(child)

    # -- leaving -----------------------------------------------------------------------------
    def preempt(self, seq: Sequence) -> None:
        """Swap out (KV to the host tier, kept progress) or recompute later (blocks freed,
        restart from token 0), as the chooser decides; front of the waiting queue."""
        if not self._swap_out(seq):
            self.block_manager.free(seq.seq_id)
            seq.num_computed_tokens = 0
        self.forget_table(seq.seq_id)
        self.running.remove(seq)
        seq.status = WAITING
        seq.num_preemptions += 1
        self.waiting.appendleft(seq)
        self.preempted.append(seq.seq_id)

    def _swap_out(self, seq: Sequence) -> bool:
        chooser, bm = self.chooser, self.block_manager
        if chooser is None:
            return False
        blocks = len(bm.block_table(seq.seq_id))
        swapped = chooser.prefers_swap(blocks, seq.num_computed_tokens) and bm.swap_out(seq.seq_id)
        chooser.count(swapped)
        return swapped

    def finish(self, seq: Sequence, reason: str, stop_reason: int | str | None) -> None:
        """Finish a running `seq` that a stop rule ended: free its blocks, forget it."""
        self.block_manager.free(seq.seq_id)
        self.forget_table(seq.seq_id)
        del self.seqs[seq.seq_id]
        seq.finish(reason, stop_reason)
        self.forget_if_done(seq.request_id)

    def finish_if_stopped(self, seq: Sequence, config: SchedulerConfig) -> bool:
        """Finish `seq` (freeing its blocks) if a stop rule fires; True if it finished."""
        stop = stop_status(seq, config.eos_token_ids, config.max_model_len)
        if stop is None:
            return False
        self.finish(seq, *stop)
        return True

    def abort(self, request_id: str) -> list[Sequence]:
        """Free every block of the request; the sequences it ended. Idempotent."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return []
        aborted = []
        for seq in request.seqs:
            if seq.status.is_finished:
                continue
            self.drop(seq)
            seq.finish("abort")
            aborted.append(seq)
        return aborted

    def end_live(self, seq_id: str, reason: str, stop_reason: int | str | None) -> Sequence:
        """Finish a live sequence for `reason`; InvalidParameterError if there is none."""
        seq = self.seqs.get(seq_id)
        if seq is None:
            raise InvalidParameterError("seq_id", f"{seq_id!r} is not a live sequence")
        self.drop(seq)
        seq.finish(reason, stop_reason)
        self.forget_if_done(seq.request_id)
        return seq

    def release_prefilled(self, request_id: str) -> list[Sequence]:
        """Drop the PREFILLED sequences of a parked request and forget it; those dropped."""
        request = self.requests.get(request_id)
        if request is None or not is_prefilled(request):
            raise InvalidParameterError("request_id", f"{request_id!r} is not a prefilled request")
        del self.requests[request_id]
        parked = [seq for seq in request.seqs if seq.status is PREFILLED]
        for seq in parked:
            self.drop(seq)
        return parked

    def drop(self, seq: Sequence) -> None:
        """Remove a live sequence from every queue and free its blocks."""
        if seq.status is RUNNING:
            self.running.remove(seq)
        elif seq.status is WAITING:
            self.waiting.remove(seq)
        if self.block_manager.has(seq.seq_id) or self.block_manager.is_swapped(seq.seq_id):
            self.block_manager.free(seq.seq_id)
        self.forget_table(seq.seq_id)
        self.seqs.pop(seq.seq_id, None)

    def forget_if_done(self, request_id: str) -> None:
        request = self.requests.get(request_id)
        if request is not None and request.is_finished:
            del self.requests[request_id]


def is_prefilled(request: Request) -> bool:
    """Whether a request is parked: some sequence PREFILLED, every other one finished."""
    statuses = [seq.status for seq in request.seqs]
    return PREFILLED in statuses and all(s is PREFILLED or s.is_finished for s in statuses)
