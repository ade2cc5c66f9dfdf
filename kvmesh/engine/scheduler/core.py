"""`Scheduler`: plans each step (`schedule`), applies its results (`update`), holds requests.

The policy is described in `kvmesh.engine.scheduler`; admission and the preemption victim are
in `policy`, the queues in `state`, stop rules in `stops`, the plan's types in `plan`.
"""

from __future__ import annotations

from collections.abc import Mapping
from collections.abc import Sequence as Seq
from itertools import islice

from kvmesh.engine.errors import InvalidParameterError
from kvmesh.engine.scheduler import policy, remote
from kvmesh.engine.scheduler.config import SchedulerConfig
from kvmesh.engine.scheduler.plan import SchedulerOutput
from kvmesh.engine.scheduler.state import PREFILLED, REMOTE_KV, RUNNING, WAITING, SchedulerState
from kvmesh.engine.scheduler.stops import (
    prepare_stop_check,
    validate_request,
)
from kvmesh.engine.sequence import Request, Sequence
from kvmesh.memory import BlockManager


class Scheduler:
    """Plans steps over a `BlockManager`; see `kvmesh.engine.scheduler` for the policy."""

    def __init__(self, config: SchedulerConfig, block_manager: BlockManager) -> None:
        self.config = config
        self.block_manager = block_manager
        self.state = SchedulerState(block_manager, config.preemption)
        self.num_preemptions = 0
        # prefill-first: prompt tokens computed in prompt-only steps since the decodes last
        # ran, its limit, and whether a running sequence may still be prefilling (cleared once
        # a step planned no prompt work and found none)
        self._prefill_first = config.scheduling_policy == "prefill-first"
        self._stall_limit = config.max_decode_stall_tokens
        self._stalled_tokens = 0
        self._maybe_prefilling = False

    # -- planning ----------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        """Plan one step (see `kvmesh.engine.scheduler`); mutates only scheduling state."""
        state, config = self.state, self.config
        state.begin_step()
        if config.policy == "static" and not state.running:
            policy.enroll_static_batch(state, config)
        budget = config.max_num_batched_tokens
        planned_prompts = False
        if self._prefill_first:
            budget, planned_prompts = self._plan_prefill_first(budget)
        if not planned_prompts:  # a decode-first step (also prefill-first's when it planned none)
            prefilling: list[Sequence] = []
            budget = self._plan_decodes(budget, prefilling)
            planned = state.step.num_chunks
            budget = self._plan_prompts(budget, prefilling)
            self._stalled_tokens = 0
            prompts = state.step.num_chunks > planned
            self._maybe_prefilling = bool(prefilling) or prompts or not budget
        return self._output(config.max_num_batched_tokens - budget)

    def _output(self, num_batched_tokens: int) -> SchedulerOutput:
        """Freeze the planned step; departures ride on the first plan with work for the runner."""
        state = self.state
        departed: tuple[str, ...] = ()
        if state.step.num_chunks and state.departed:
            departed, state.departed = tuple(state.departed), []
        return state.step.build(
            departed,
            tuple(state.copy_pairs),
            num_batched_tokens,
            tuple(state.preempted),
            state.block_size,
        )

    def _plan_prefill_first(self, budget: int) -> tuple[int, bool]:
        """Prefill-first: plan a prompt-only step; the budget left and whether it planned any.

        Tried only while the decodes have waited less than `_stall_limit` prompt tokens and
        prompt work may exist (a waiting sequence, or a running one that may be prefilling).
        Plans nothing when admission takes nobody and no running sequence is prefilling; the
        caller then plans a decode-first step. The step's tokens count towards the decodes'
        wait when a running sequence got no chunk in it.
        """
        if self._stalled_tokens >= self._stall_limit:
            return budget, False
        state = self.state
        if not (state.waiting or self._maybe_prefilling):
            return budget, False
        running = state.running
        prefilling = [seq for seq in running if policy.is_prefilling(seq)]
        left = self._plan_prompts(budget, prefilling)
        if not state.step.num_chunks:
            return left, False
        self._maybe_prefilling = True
        if len(running) > len(state.planned):
            self._stalled_tokens += budget - left
        return left, True

    def _plan_prompts(self, budget: int, prefilling: list[Sequence]) -> int:
        """Prompt work: a chunk for each running sequence still prefilling, oldest first, then
        (continuous batching) FCFS admission; the budget left."""
        config = self.config
        for seq in prefilling:
            if budget == 0:
                break
            size = policy.chunk_size(seq, budget, config) if seq.status is RUNNING else 0
            if size and self._plan_running(seq, size):
                budget -= size
        if config.policy == "continuous":
            budget = policy.admit_waiting(self.state, config, budget)
        return budget

    def _plan_decodes(self, budget: int, prefilling: list[Sequence]) -> int:
        """One token per running decode, oldest first, into the step's decode columns;
        collects the sequences still prefilling; returns the budget left.

        Hot path. A decode whose token lands inside its cached (private) last block needs
        no block manager call and no table diff: four list appends. Crossing into a new
        block, or a table not cached (new, forked or resumed), goes through `allocate`.
        """
        state = self.state
        bs, tables, step = state.block_size, state.tables, state.step
        add_id, add_start = step.decode_ids.append, step.decode_starts.append
        add_token, add_table = step.decode_tokens.append, step.decode_tables.append
        for seq in state.running[:]:  # a copy: preemption removes from `running`
            start = seq.num_computed_tokens
            tokens = seq.all_token_ids
            if len(tokens) - start != 1:
                prefilling.append(seq)  # (or preempted earlier in this loop: skipped there)
                continue
            if budget == 0:
                break
            table = tables.get(seq.seq_id)  # None once preempted earlier in this loop
            if table is None or not start % bs:
                if seq.status is not RUNNING or not self._plan_running(seq, 1):
                    continue
            else:
                add_id(seq.seq_id)
                add_start(start)
                add_token(tokens[start])
                add_table(table)
            budget -= 1
        return budget

    def _plan_running(self, seq: Sequence, size: int) -> bool:
        """Plan a chunk of `size` tokens for a running sequence, preempting others for blocks;
        False when `seq` itself was preempted, or (prompt work already begun, with no prompt
        work to evict) when it keeps its blocks and waits for a later step."""
        state = self.state
        start = seq.num_computed_tokens
        while True:
            result = self.block_manager.allocate(seq.seq_id, start + size)
            if result is not None:
                state.make_chunk(seq, start, size, result)
                return True
            victim = policy.newest_unplanned(state, seq)
            if victim is seq and start and policy.is_prefilling(seq):
                return False  # holds its blocks and waits: a decode's need evicts it if any
            state.preempt(victim)
            self.num_preemptions += 1
            if victim is seq:
                return False

    # -- results -----------------------------------------------------------------------------
    def update(self, output: SchedulerOutput, sampled: Mapping[str, int]) -> list[Sequence]:
        """Apply a step's results: progress, sampled tokens, commits, stops; changed seqs."""
        changed: list[Sequence] = []
        state = self.state
        num_decodes = output.num_decodes
        left = self._update_decodes(output, sampled, changed)
        seq_ids, starts = output.seq_ids, output.start_positions
        prefills = range(num_decodes, len(seq_ids))
        for index, size, sample_ids in zip(
            prefills, output.prefill_lens, output.prefill_samples, strict=True
        ):
            seq = self._advance(seq_ids[index], starts[index], size)
            if seq is None:
                continue
            if sample_ids and self._sample_children(seq, sample_ids, sampled, changed):
                left = True  # () mid-prefill; itself, or n children after a forking chunk
        if left:
            state.running = [seq for seq in state.running if seq.status is RUNNING]
        return changed

    def _update_decodes(
        self, output: SchedulerOutput, sampled: Mapping[str, int], changed: list[Sequence]
    ) -> bool:
        """The decode section of `update` (hot path: one token each, sampled for itself);
        True if a sequence left the batch."""
        left = False
        append_changed = changed.append
        state = self.state
        bs, seqs = state.block_size, state.seqs
        commit = self.block_manager.commit if self.config.enable_prefix_caching else None
        decodes = islice(output.seq_ids, output.num_decodes)
        for seq_id, start in zip(decodes, output.start_positions, strict=False):  # [:D] of both
            seq = seqs.get(seq_id)
            if seq is None or seq.status is not RUNNING:
                continue  # aborted or finished since it was planned
            assert seq.num_computed_tokens == start, (seq_id, start)
            computed = seq.num_computed_tokens = start + 1
            tokens = seq.all_token_ids
            if commit and not computed % bs:  # the token completed a block: publish it
                # (this also brings the manager's slot count, which in-block decodes leave
                # trailing by less than a block, up to `computed`)
                commit(seq_id, tokens, computed, seq.extra_key)
            token = sampled[seq_id]
            if seq.first_token_time is None:
                seq.append_token(token)
            else:  # `append_token` inlined
                seq.output_ids.append(token)
                tokens.append(token)
            append_changed(seq)
            if (
                token in seq.stop_token_set or len(tokens) >= seq.token_limit
            ) and self._stop_or_park(seq):
                left = True
        return left

    def _advance(self, seq_id: str, start: int, size: int) -> Sequence | None:
        """Count a prefill chunk's tokens as computed (publishing the blocks it completed); the
        sequence, or None if it left since it was planned."""
        seq = self.state.seqs.get(seq_id)
        if seq is None or seq.status is not RUNNING:
            return None
        assert seq.num_computed_tokens == start, (seq_id, start)
        computed = seq.num_computed_tokens = start + size
        if self.config.enable_prefix_caching and computed % self.state.block_size < size:
            self.block_manager.commit(seq_id, seq.all_token_ids, computed, seq.extra_key)
        return seq

    def _sample_children(
        self,
        seq: Sequence,
        sample_ids: tuple[str, ...],
        sampled: Mapping[str, int],
        changed: list[Sequence],
    ) -> bool:
        """Give each sampled sequence (`seq` itself, or its n children after a forking chunk)
        its token; True if any left the batch."""
        left = False
        for sample_id in sample_ids:
            target = self.state.seqs[sample_id]
            target.num_computed_tokens = seq.num_computed_tokens
            token = sampled[sample_id]
            target.append_token(token)
            changed.append(target)
            if (
                token in target.stop_token_set or target.num_tokens >= target.token_limit
            ) and self._stop_or_park(target):
                left = True
        return left

    def _stop_or_park(self, seq: Sequence) -> bool:
        """After a token that may end `seq` (a stop id or its token limit): finish it, or park
        a prefill-only sequence in PREFILLED at its first token. True if it left the batch."""
        if self.state.finish_if_stopped(seq, self.config):  # finished, its blocks freed
            return True
        if len(seq.output_ids) == 1 and self.state.requests[seq.request_id].prefill_only:
            seq.status = PREFILLED  # holds its blocks until released
            return True
        return False

    # -- requests ----------------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        """Queue a new request; InvalidParameterError (naming the field) if it can never run."""
        state = self.state
        if request.request_id in state.requests:
            raise InvalidParameterError("request_id", f"{request.request_id!r} already exists")
        validate_request(request, self.config, self.block_manager.num_blocks, state.block_size)
        seq = request.seqs[0]
        seq.status = WAITING
        prepare_stop_check(seq, self.config)
        if request.prefill_only:  # its first token parks it (see `_stop_or_park`)
            seq.token_limit = min(seq.token_limit, seq.num_prompt_tokens + 1)
        state.requests[request.request_id] = request
        state.seqs[seq.seq_id] = seq
        state.waiting.append(seq)

    def abort_request(self, request_id: str) -> list[Sequence]:
        """Free every block of the request at once (a request waiting for remote KV: its
        spares too); the sequences it ended. Idempotent."""
        request = self.state.requests.get(request_id)
        if request is not None and request.seqs[0].status is REMOTE_KV:
            remote.free_spares(self.state, request_id)
        return self.state.abort(request_id)

    def finish_sequence(
        self, seq_id: str, reason: str = "stop", stop_reason: int | str | None = None
    ) -> Sequence:
        """End a live sequence for a reason found outside the scheduler (a stop string)."""
        return self.state.end_live(seq_id, reason, stop_reason)

    def get_request(self, request_id: str) -> Request | None:
        return self.state.requests.get(request_id)

    def has_unfinished(self) -> bool:
        return bool(self.state.waiting or self.state.running)

    @property
    def num_running(self) -> int:
        return len(self.state.running)

    @property
    def num_waiting(self) -> int:
        return len(self.state.waiting)

    # -- disaggregation (see `kvmesh.engine.scheduler` and `remote`) -------------------------
    def add_remote_request(self, request: Request, spare_blocks: int = 0) -> list[int] | None:
        """Hold a request whose prompt KV another worker computes: empty blocks for the prompt
        (plus `spare_blocks` for its forks' first step, held under child 1's id) and the
        request in WAITING_FOR_REMOTE_KV, never scheduled, until `add_prefilled_request` joins
        it (or `abort_request` drops it). The prompt's block ids, or None (nothing held) when
        the pool is short now."""
        return remote.hold_for_remote_kv(self.state, self.config, request, spare_blocks)

    def add_prefilled_request(
        self,
        request: Request,
        num_computed_tokens: int,
        first_tokens: Seq[int],
        *,
        kv_written: bool = True,
    ) -> list[Sequence]:
        """Join a request whose prompt KV was computed elsewhere directly as decodes.

        The request waits for its KV (`add_remote_request`), or the caller allocated
        `request.seqs[0].seq_id` in the BlockManager for the prompt; either way its KV was
        written there. `first_tokens[i]` is completion i's first token (`params.n` of them):
        with n > 1 the sequence is forked into n children sharing the prompt blocks copy on
        write, as a local request forks at its final prefill chunk (its spares are freed
        first: the forks' first writes take them back). Returns the sequences whose first
        token already ends them (their blocks freed). `kv_written=False` (no KV came: the first
        tokens end every completion) publishes none of the blocks to the prefix cache: they
        hold no KV of this prompt.
        """
        return remote.join_prefilled(
            self.state, self.config, request, num_computed_tokens, first_tokens, kv_written
        )

    def release_prefilled(self, request_id: str) -> list[Sequence]:
        """Free the blocks of a PREFILLED request (its KV was shipped) and forget it.

        With n > 1, children whose first token ended them are already finished; every other
        sequence must be PREFILLED. Returns the sequences released.
        """
        return self.state.release_prefilled(request_id)

    @property
    def num_prefilled(self) -> int:
        return sum(1 for seq in self.state.seqs.values() if seq.status is PREFILLED)
