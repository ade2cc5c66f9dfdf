"""Disaggregation hooks: prefill-only requests park in PREFILLED; prefilled ones join as decodes.

Prefill role: a `Request(prefill_only=True)` is scheduled until its first token is sampled,
then waits in PREFILLED holding its blocks (not running, not counted by `has_unfinished`);
the service ships the blocks and calls `release_prefilled`. Decode role: the service allocates
the prompt's slots in the BlockManager, writes the received KV and calls
`add_prefilled_request`, which joins the request to the running batch as a decode.
"""

from __future__ import annotations

from kvmesh.engine.errors import InvalidParameterError
from kvmesh.engine.scheduler_state import PREFILLED, RUNNING, SchedulerState
from kvmesh.engine.scheduler_stops import prepare_stop_check, validate_request
from kvmesh.engine.sequence import Request, Sequence


class DisaggregationMixin(SchedulerState):
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
        if request is None or any(s.status is not PREFILLED for s in request.seqs):
            raise InvalidParameterError("request_id", f"{request_id!r} is not a prefilled request")
        del self._requests[request_id]
        for seq in request.seqs:
            self._drop(seq)
        return request.seqs

    @property
    def num_prefilled(self) -> int:
        return sum(1 for seq in self._seqs.values() if seq.status is PREFILLED)
