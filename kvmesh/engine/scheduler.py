"""Continuous batching with chunked prefill, prefix caching, preemption by recompute.

Each `schedule()` plans one step within `max_num_batched_tokens` and `max_num_seqs`:

    1. running decodes, oldest first (one token each)
    2. running sequences still prefilling, oldest first (a chunk each, as budget allows)
    3. waiting sequences, first come first served (prefix lookup, then a first chunk)
       until the budget, the sequence limit or the blocks run out

When a running sequence cannot get a block, the newest running sequence not yet planned this
step (itself as the last resort) is preempted: its blocks are freed, it restarts from token 0
and goes to the FRONT of the waiting queue. Blocks are published to the prefix cache in
`update()`, once their KV is computed. The scheduler speaks policy only: integers, no tensors.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping

from kvmesh.engine.errors import InvalidParameterError
from kvmesh.engine.scheduler_stops import (
    max_total_tokens,
    prepare_stop_check,
    stop_status,
    validate_request,
)
from kvmesh.engine.scheduler_types import (
    ALLOCATIONS,
    POLICIES,
    ScheduledChunk,
    SchedulerConfig,
    SchedulerOutput,
)
from kvmesh.engine.sequence import Request, Sequence, SequenceStatus, child_seq_id
from kvmesh.memory import AllocResult, BlockManager

__all__ = [
    "ALLOCATIONS",
    "POLICIES",
    "ScheduledChunk",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerOutput",
]

RUNNING = SequenceStatus.RUNNING
WAITING = SequenceStatus.WAITING


class Scheduler:
    """Plans steps over a `BlockManager`; see the module docstring for the policy."""

    def __init__(self, config: SchedulerConfig, block_manager: BlockManager) -> None:
        self.config = config
        self.block_manager = block_manager
        self._bs = block_manager.block_size
        self._requests: dict[str, Request] = {}
        self._seqs: dict[str, Sequence] = {}  # live sequences (waiting, running, prefilled)
        self._waiting: deque[Sequence] = deque()
        self._running: list[Sequence] = []  # admission order: newest last
        self._tables: dict[str, tuple[int, ...]] = {}  # block tables as last planned
        self._planned: set[str] = set()  # sequences with a chunk in the step being planned
        self._copy_pairs: list[tuple[int, int]] = []
        self._preempted: list[str] = []
        self.num_preemptions = 0

    # -- requests ----------------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        """Queue a new request; InvalidParameterError (naming the field) if it can never run."""
        if request.request_id in self._requests:
            raise InvalidParameterError("request_id", f"{request.request_id!r} already exists")
        bm = self.block_manager
        validate_request(request, self.config, bm.num_blocks, self._bs)
        seq = request.seqs[0]
        seq.status = WAITING
        prepare_stop_check(seq, self.config)
        self._requests[request.request_id] = request
        self._seqs[seq.seq_id] = seq
        self._waiting.append(seq)

    def abort_request(self, request_id: str) -> list[Sequence]:
        """Free every block of the request at once; the sequences it ended. Idempotent."""
        request = self._requests.pop(request_id, None)
        if request is None:
            return []
        aborted = []
        for seq in request.seqs:
            if seq.status.is_finished:
                continue
            self._drop(seq)
            seq.finish("abort")
            aborted.append(seq)
        return aborted

    def finish_sequence(
        self, seq_id: str, reason: str = "stop", stop_reason: int | str | None = None
    ) -> Sequence:
        """End a live sequence for a reason found outside the scheduler (a stop string)."""
        seq = self._seqs.get(seq_id)
        if seq is None:
            raise InvalidParameterError("seq_id", f"{seq_id!r} is not a live sequence")
        self._drop(seq)
        seq.finish(reason, stop_reason)
        self._forget_if_done(seq.request_id)
        return seq

    # -- disaggregation hooks ----------------------------------------------------------------
    def add_prefilled_request(
        self, request: Request, num_computed_tokens: int, first_token: int
    ) -> list[Sequence]:
        """Join a request whose prompt KV was computed elsewhere directly as a decode.

        The caller allocated `request.seqs[0].seq_id` in the BlockManager for the prompt and
        wrote its KV. Returns the sequence if `first_token` already ends it (blocks freed).
        """
        if request.request_id in self._requests:
            raise InvalidParameterError("request_id", f"{request.request_id!r} already exists")
        validate_request(request, self.config, self.block_manager.num_blocks, self._bs)
        seq = request.seqs[0]
        if num_computed_tokens != seq.num_tokens:
            raise InvalidParameterError(
                "num_computed_tokens",
                f"must equal the prompt length {seq.num_tokens}, got {num_computed_tokens}",
            )
        held = self.block_manager.num_tokens(seq.seq_id)
        if held < num_computed_tokens:
            raise InvalidParameterError(
                "num_computed_tokens", f"{num_computed_tokens} exceeds the {held} slots allocated"
            )
        seq.num_computed_tokens = num_computed_tokens
        seq.status = RUNNING
        prepare_stop_check(seq, self.config)
        self._requests[request.request_id] = request
        self._seqs[seq.seq_id] = seq
        self._running.append(seq)
        seq.append_token(first_token)
        if self.config.enable_prefix_caching:
            self.block_manager.commit(
                seq.seq_id, seq.all_token_ids, num_computed_tokens, seq.extra_key
            )
        if self._apply_stop(seq):
            self._running.remove(seq)
            return [seq]
        return []

    def release_prefilled(self, request_id: str) -> list[Sequence]:
        """Free the blocks of a PREFILLED request (its KV was shipped) and forget it."""
        request = self._requests.get(request_id)
        if request is None or any(s.status is not SequenceStatus.PREFILLED for s in request.seqs):
            raise InvalidParameterError("request_id", f"{request_id!r} is not a prefilled request")
        del self._requests[request_id]
        for seq in request.seqs:
            self._drop(seq)
        return request.seqs

    @property
    def num_prefilled(self) -> int:
        return sum(1 for seq in self._seqs.values() if seq.status is SequenceStatus.PREFILLED)

    def get_request(self, request_id: str) -> Request | None:
        return self._requests.get(request_id)

    def has_unfinished(self) -> bool:
        return bool(self._waiting or self._running)

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    # -- planning ----------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        """Plan one step (see the module docstring); mutates only scheduling state."""
        self._planned.clear()
        self._copy_pairs = []
        self._preempted = []
        budget = self.config.max_num_batched_tokens
        if self.config.policy == "static" and not self._running:
            self._enroll_static_batch()
        decodes: list[ScheduledChunk] = []
        prefilling: list[Sequence] = []
        budget = self._plan_decodes(budget, decodes, prefilling)
        prefills: list[ScheduledChunk] = []
        for seq in prefilling:
            if budget == 0:
                break
            size = self._chunk_size(seq, budget) if seq.status is RUNNING else 0
            chunk = self._plan_running(seq, size) if size else None
            if chunk is not None:
                prefills.append(chunk)
                budget -= size
        if self.config.policy == "continuous":
            budget = self._admit_waiting(budget, prefills)
        return SchedulerOutput(
            chunks=(*decodes, *prefills),
            copy_pairs=tuple(self._copy_pairs),
            num_batched_tokens=self.config.max_num_batched_tokens - budget,
            preempted_seq_ids=tuple(self._preempted),
        )

    def _plan_decodes(
        self, budget: int, decodes: list[ScheduledChunk], prefilling: list[Sequence]
    ) -> int:
        """One token per running decode, oldest first; collects the still-prefilling ones.

        Hot path. A decode whose token lands in its (private) last block skips the block
        manager: the table is unchanged. Crossing a block boundary, or a table not yet cached
        (new, forked or just resumed), goes through `allocate`.
        """
        bs, tables, planned = self._bs, self._tables, self._planned
        for seq in list(self._running):
            if seq.status is not RUNNING:
                continue  # preempted earlier in this loop
            start = seq.num_computed_tokens
            tokens = seq.all_token_ids
            if len(tokens) - start != 1:
                prefilling.append(seq)
                continue
            if budget == 0:
                break
            seq_id = seq.seq_id
            table = tables.get(seq_id)
            if table is None or start % bs == 0:
                chunk = self._plan_running(seq, 1)
                if chunk is None:
                    continue
            else:
                slot = table[start // bs] * bs + start % bs
                chunk = ScheduledChunk(seq_id, (tokens[start],), start, table, (slot,), (seq_id,))
                planned.add(seq_id)
            decodes.append(chunk)
            budget -= 1
        return budget

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
        for other in reversed(self._running):
            if other is not seq and other.seq_id not in self._planned:
                return other
        return seq

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

    def _make_chunk(
        self, seq: Sequence, start: int, size: int, result: AllocResult | None
    ) -> ScheduledChunk:
        seq_id = seq.seq_id
        bm = self.block_manager
        table = self._tables.get(seq_id)
        if table is None or result is None or result.new_blocks or result.copy_pairs:
            table = self._tables[seq_id] = tuple(bm.block_table(seq_id))
            if result is not None and result.copy_pairs:
                self._copy_pairs.extend(result.copy_pairs)
        end = start + size
        if size == 1:
            bs = self._bs
            slots: tuple[int, ...] = (table[start // bs] * bs + start % bs,)
            tokens: tuple[int, ...] = (seq.all_token_ids[start],)
        else:
            slots = tuple(bm.slot_mapping(seq_id, start, end))
            tokens = tuple(seq.all_token_ids[start:end])
        self._planned.add(seq_id)
        sample_ids: tuple[str, ...] = ()
        if end == seq.num_tokens:
            sample_ids = self._fork_children(seq) if seq.params.n > 1 else (seq_id,)
        return ScheduledChunk(seq_id, tokens, start, table, slots, sample_ids)

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

    # -- results -----------------------------------------------------------------------------
    def update(self, output: SchedulerOutput, sampled: Mapping[str, int]) -> list[Sequence]:
        """Apply a step's results: progress, sampled tokens, commits, stops; changed seqs."""
        changed: list[Sequence] = []
        left = False
        bs, seqs = self._bs, self._seqs
        commit = self.config.enable_prefix_caching
        for chunk in output.chunks:
            seq = seqs.get(chunk.seq_id)
            if seq is None or seq.status is not RUNNING:
                continue  # aborted or finished since it was planned
            start = chunk.start_pos
            assert seq.num_computed_tokens == start, (seq.seq_id, start)
            computed = start + len(chunk.token_ids)
            seq.num_computed_tokens = computed
            if commit and computed // bs > start // bs:
                self._commit(seq, computed)
            for sample_id in chunk.sample_seq_ids:
                target = seq if sample_id == chunk.seq_id else seqs[sample_id]
                target.num_computed_tokens = computed
                token = sampled[sample_id]
                target.append_token(token)
                changed.append(target)
                if (
                    token in target.stop_token_set or target.num_tokens >= target.token_limit
                ) and self._apply_stop(target):
                    left = True
                elif len(target.output_ids) == 1 and self._requests[target.request_id].prefill_only:
                    target.status = SequenceStatus.PREFILLED  # holds its blocks until released
                    left = True
        if left:
            self._running = [seq for seq in self._running if seq.status is RUNNING]
        return changed

    def _commit(self, seq: Sequence, computed: int) -> None:
        """Publish newly full blocks; first bring the manager's slot count up to `computed`
        (in-block decodes skip `allocate`, so it may trail by less than a block)."""
        bm = self.block_manager
        bm.allocate(seq.seq_id, computed)
        bm.commit(seq.seq_id, seq.all_token_ids, computed, seq.extra_key)

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
