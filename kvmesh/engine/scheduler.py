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

Parts: admission (`scheduler_admission`), preemption (`scheduler_preemption`), the
disaggregation hooks (`scheduler_disagg`), shared state (`scheduler_state`), stop rules
(`scheduler_stops`) and the plan's types (`scheduler_types`). Blocks are published to the
prefix cache in `update()`, once their KV is computed. The scheduler speaks policy only:
integers, no tensors.
"""

from __future__ import annotations

from collections.abc import Mapping

from kvmesh.engine.errors import InvalidParameterError
from kvmesh.engine.scheduler_admission import AdmissionMixin
from kvmesh.engine.scheduler_disagg import DisaggregationMixin
from kvmesh.engine.scheduler_preemption import PreemptionMixin
from kvmesh.engine.scheduler_state import RUNNING, WAITING, new_chunk
from kvmesh.engine.scheduler_stops import prepare_stop_check, validate_request
from kvmesh.engine.scheduler_types import (
    ALLOCATIONS,
    POLICIES,
    ScheduledChunk,
    SchedulerConfig,
    SchedulerOutput,
)
from kvmesh.engine.sequence import Request, Sequence

__all__ = [
    "ALLOCATIONS",
    "POLICIES",
    "ScheduledChunk",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerOutput",
]


class Scheduler(DisaggregationMixin, AdmissionMixin, PreemptionMixin):
    """Plans steps over a `BlockManager`; see the module docstring for the policy."""

    # -- requests ----------------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        """Queue a new request; InvalidParameterError (naming the field) if it can never run."""
        if request.request_id in self._requests:
            raise InvalidParameterError("request_id", f"{request.request_id!r} already exists")
        validate_request(request, self.config, self.block_manager.num_blocks, self._bs)
        seq = request.seqs[0]
        seq.status = WAITING
        prepare_stop_check(seq, self.config)
        if request.prefill_only:  # its first token parks it (see `_stop_or_park`)
            seq.token_limit = min(seq.token_limit, seq.num_prompt_tokens + 1)
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
        self._begin_step()
        config = self.config
        if config.policy == "static" and not self._running:
            self._enroll_static_batch()
        budget = config.max_num_batched_tokens
        prefills: list[ScheduledChunk] = []
        if self._prefill_first:
            budget = self._plan_prefill_first(budget, prefills)
        if not prefills:  # a decode-first step (also prefill-first's when it planned nothing)
            prefilling: list[Sequence] = []
            budget = self._plan_decodes(budget, prefilling)
            budget = self._plan_prompts(budget, prefilling, prefills)
            self._stalled_tokens = 0
            self._maybe_prefilling = bool(prefilling or prefills) or not budget
        return SchedulerOutput(
            chunks=(*self._decodes, *prefills),
            copy_pairs=tuple(self._copy_pairs),
            num_batched_tokens=config.max_num_batched_tokens - budget,
            preempted_seq_ids=tuple(self._preempted),
        )

    def _plan_prefill_first(self, budget: int, prefills: list[ScheduledChunk]) -> int:
        """Prefill-first: plan a prompt-only step into `prefills`; the budget left.

        Tried only while the decodes have waited less than `_stall_limit` prompt tokens and
        prompt work may exist (a waiting sequence, or a running one that may be prefilling).
        Plans nothing when admission takes nobody and no running sequence is prefilling; the
        caller then plans a decode-first step. The step's tokens count towards the decodes'
        wait when a running sequence got no chunk in it.
        """
        if self._stalled_tokens >= self._stall_limit:
            return budget
        if not (self._waiting or self._maybe_prefilling):
            return budget
        running = self._running
        prefilling = [
            seq for seq in running if len(seq.all_token_ids) - seq.num_computed_tokens != 1
        ]
        left = self._plan_prompts(budget, prefilling, prefills)
        if prefills:
            self._maybe_prefilling = True
            if len(running) > len(self._planned):
                self._stalled_tokens += budget - left
        return left

    def _plan_prompts(
        self, budget: int, prefilling: list[Sequence], prefills: list[ScheduledChunk]
    ) -> int:
        """Prompt work into `prefills`: a chunk for each running sequence still prefilling,
        oldest first, then (continuous batching) FCFS admission; the budget left."""
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
        return budget

    def _plan_decodes(self, budget: int, prefilling: list[Sequence]) -> int:
        """One token per running decode, oldest first, into `_decodes`; collects the
        sequences still prefilling; returns the budget left.

        Hot path. A decode whose token lands inside its cached (private) last block needs
        no block manager call: its slot is `table[pos // bs] * bs + pos % bs`. Crossing into
        a new block, or a table not cached (new, forked or resumed), goes through `allocate`.
        """
        bs, tables, decodes = self._bs, self._tables, self._decodes
        append = decodes.append
        for seq in self._running[:]:  # a copy: preemption removes from `_running`
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
            offset = start % bs
            if table is None or not offset:
                chunk = self._plan_running(seq, 1)
                if chunk is None:
                    continue
                append(chunk)
            else:
                slot = table[start // bs] * bs + offset
                append(
                    new_chunk(
                        ScheduledChunk, (seq_id, (tokens[start],), start, table, (slot,), (seq_id,))
                    )
                )
            budget -= 1
        return budget

    # -- results -----------------------------------------------------------------------------
    def update(self, output: SchedulerOutput, sampled: Mapping[str, int]) -> list[Sequence]:
        """Apply a step's results: progress, sampled tokens, commits, stops; changed seqs."""
        changed: list[Sequence] = []
        append_changed = changed.append
        left = False
        bs, seqs = self._bs, self._seqs
        commit = self.block_manager.commit if self.config.enable_prefix_caching else None
        for seq_id, token_ids, start, _, _, sample_ids in output.chunks:
            seq = seqs.get(seq_id)
            if seq is None or seq.status is not RUNNING:
                continue  # aborted or finished since it was planned
            assert seq.num_computed_tokens == start, (seq_id, start)
            size = len(token_ids)
            computed = start + size
            seq.num_computed_tokens = computed
            if commit and computed % bs < size:  # the chunk completed a block: publish it
                # (this also brings the manager's slot count, which in-block decodes leave
                # trailing by less than a block, up to `computed`)
                commit(seq_id, seq.all_token_ids, computed, seq.extra_key)
            if len(sample_ids) != 1:  # () mid-prefill; n children after a forking chunk
                if sample_ids and self._sample_children(seq, sample_ids, sampled, changed):
                    left = True
                continue
            token = sampled[seq_id]  # hot path: one token for the sequence itself
            tokens = seq.all_token_ids
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
        if left:
            self._running = [seq for seq in self._running if seq.status is RUNNING]
        return changed

    def _sample_children(
        self,
        seq: Sequence,
        sample_ids: tuple[str, ...],
        sampled: Mapping[str, int],
        changed: list[Sequence],
    ) -> bool:
        """Give each of the n children its first token; True if any left the batch."""
        left = False
        for sample_id in sample_ids:
            target = self._seqs[sample_id]
            target.num_computed_tokens = seq.num_computed_tokens
            token = sampled[sample_id]
            target.append_token(token)
            changed.append(target)
            if (
                token in target.stop_token_set or target.num_tokens >= target.token_limit
            ) and self._stop_or_park(target):
                left = True
        return left
