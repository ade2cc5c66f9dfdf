"""Disaggregation hooks: prefill-only requests park in PREFILLED; prefilled ones join as decodes.

Prefill role: a `Request(prefill_only=True)` is scheduled until its first token is sampled,
then waits in PREFILLED holding its blocks (not running, not counted by `has_unfinished`);
with n > 1 it forks at its final chunk like any request, and each child parks with its own
first token, all sharing the prompt blocks. The service ships the blocks and calls
`release_prefilled`. Decode role: the service allocates the prompt's slots in the
BlockManager, writes the received KV and calls `add_prefilled_request`, which joins the
request to the running batch as n decodes sharing those blocks copy on write.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

from kvmesh.engine.errors import InvalidParameterError
from kvmesh.engine.scheduler_state import PREFILLED, RUNNING, SchedulerState
from kvmesh.engine.scheduler_stops import prepare_stop_check, validate_request
from kvmesh.engine.sequence import Request, Sequence, child_seq_id


class DisaggregationMixin(SchedulerState):
    def add_prefilled_request(
        self, request: Request, num_computed_tokens: int, first_tokens: Seq[int]
    ) -> list[Sequence]:
        """Join a request whose prompt KV was computed elsewhere directly as decodes.

        The caller allocated `request.seqs[0].seq_id` in the BlockManager for the prompt and
        wrote its KV. `first_tokens[i]` is completion i's first token (`params.n` of them):
        with n > 1 the sequence is forked into n children sharing the prompt blocks copy on
        write, as a local request forks at its final prefill chunk. Returns the sequences
        whose first token already ends them (their blocks freed).
        """
        if request.request_id in self._requests:
            raise InvalidParameterError("request_id", f"{request.request_id!r} already exists")
        validate_request(request, self.config, self.block_manager.num_blocks, self._bs)
        seq = request.seqs[0]
        self._check_import(seq, num_computed_tokens, first_tokens)
        seq.num_computed_tokens = num_computed_tokens
        seq.status = RUNNING
        prepare_stop_check(seq, self.config)
        self._requests[request.request_id] = request
        self._seqs[seq.seq_id] = seq
        self._running.append(seq)
        if self.config.enable_prefix_caching:
            self.block_manager.commit(
                seq.seq_id, seq.all_token_ids, num_computed_tokens, seq.extra_key
            )
        for index in range(1, len(first_tokens)):  # children share every block (ref +1)
            child = seq.fork(child_seq_id(request.request_id, index))
            self.block_manager.fork(seq.seq_id, child.seq_id)
            request.seqs.append(child)
            self._seqs[child.seq_id] = child
            self._running.append(child)
        ended = []
        for child, token in zip(list(request.seqs), first_tokens, strict=True):
            child.append_token(token)
            if self._apply_stop(child):
                self._running.remove(child)
                ended.append(child)
        return ended

    def _check_import(self, seq: Sequence, num_computed: int, first_tokens: Seq[int]) -> None:
        """InvalidParameterError naming the argument that does not fit the request."""
        if num_computed != seq.num_tokens:
            raise InvalidParameterError(
                "num_computed_tokens",
                f"must equal the prompt length {seq.num_tokens}, got {num_computed}",
            )
        if len(first_tokens) != seq.params.n:
            raise InvalidParameterError(
                "first_tokens", f"expected n = {seq.params.n} tokens, got {len(first_tokens)}"
            )
        held = self.block_manager.num_tokens(seq.seq_id)
        if held < num_computed:
            raise InvalidParameterError(
                "num_computed_tokens", f"{num_computed} exceeds the {held} slots allocated"
            )

    def release_prefilled(self, request_id: str) -> list[Sequence]:
        """Free the blocks of a PREFILLED request (its KV was shipped) and forget it.

        With n > 1, children whose first token ended them are already finished; every other
        sequence must be PREFILLED. Returns the sequences released.
        """
        request = self._requests.get(request_id)
        if request is None or not is_prefilled(request):
            raise InvalidParameterError("request_id", f"{request_id!r} is not a prefilled request")
        del self._requests[request_id]
        parked = [seq for seq in request.seqs if seq.status is PREFILLED]
        for seq in parked:
            self._drop(seq)
        return parked

    @property
    def num_prefilled(self) -> int:
        return sum(1 for seq in self._seqs.values() if seq.status is PREFILLED)


def is_prefilled(request: Request) -> bool:
    """Whether a request is parked: some sequence PREFILLED, every other one finished."""
    statuses = [seq.status for seq in request.seqs]
    return PREFILLED in statuses and all(s is PREFILLED or s.is_finished for s in statuses)
