"""The decode role's side of disaggregation: requests whose prompt KV another worker computes.

`hold_for_remote_kv` reserves the prompt's blocks (and spares for an n > 1 request's forks)
while the KV travels; `join_prefilled` turns the request into running decodes once it was
written. See `kvmesh.engine.scheduler` for the protocol.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

from kvmesh.engine.errors import InvalidParameterError
from kvmesh.engine.scheduler.config import SchedulerConfig
from kvmesh.engine.scheduler.state import REMOTE_KV, SchedulerState
from kvmesh.engine.scheduler.stops import prepare_stop_check, validate_import, validate_request
from kvmesh.engine.sequence import Request, Sequence, child_seq_id


def hold_for_remote_kv(
    state: SchedulerState, config: SchedulerConfig, request: Request, spare_blocks: int
) -> list[int] | None:
    """Blocks for the prompt (plus `spare_blocks` under child 1's id) and the request in
    WAITING_FOR_REMOTE_KV; the prompt's block ids, or None (nothing held) when short now.
    InvalidParameterError (nothing held) for a request or `spare_blocks` refused."""
    if not isinstance(spare_blocks, int) or spare_blocks < 0:
        raise InvalidParameterError(
            "spare_blocks", f"must be a non-negative int, got {spare_blocks!r}"
        )
    bm = state.block_manager
    rid, seq = request.request_id, request.seqs[0]
    spare_id = child_seq_id(rid, 1)
    if rid in state.requests or bm.has(seq.seq_id) or (spare_blocks and bm.has(spare_id)):
        raise InvalidParameterError("request_id", f"{rid!r} already exists")
    validate_request(request, config, bm.num_blocks, state.block_size)
    if -(-seq.num_tokens // bm.block_size) + spare_blocks > bm.num_free_blocks:
        return None
    if bm.allocate(seq.seq_id, seq.num_tokens) is None:
        return None
    if spare_blocks and bm.allocate(spare_id, spare_blocks * bm.block_size) is None:
        bm.free(seq.seq_id)
        return None
    seq.status = REMOTE_KV
    state.requests[rid] = request
    state.seqs[seq.seq_id] = seq
    return bm.block_table(seq.seq_id)


def join_prefilled(
    state: SchedulerState,
    config: SchedulerConfig,
    request: Request,
    num_computed_tokens: int,
    first_tokens: Seq[int],
    kv_written: bool = True,
) -> list[Sequence]:
    """Join the request as `len(first_tokens)` running decodes (see
    `Scheduler.add_prefilled_request`); the sequences its first tokens already end. Blocks
    are published to the prefix cache only when their KV was written (`kv_written`)."""
    bm = state.block_manager
    rid, seq = request.request_id, request.seqs[0]
    remote = state.requests.get(rid) is request and seq.status is REMOTE_KV
    if rid in state.requests and not remote:
        raise InvalidParameterError("request_id", f"{rid!r} already exists")
    validate_request(request, config, bm.num_blocks, state.block_size)
    validate_import(seq, num_computed_tokens, first_tokens, bm)
    if remote:
        del state.requests[rid]
        del state.seqs[seq.seq_id]
    free_spares(state, rid)
    prepare_stop_check(seq, config)
    commit = config.enable_prefix_caching and kv_written
    state.join_prefilled(request, num_computed_tokens, len(first_tokens), commit=commit)
    ended = []
    for child, token in zip(list(request.seqs), first_tokens, strict=True):
        child.append_token(token)
        if state.finish_if_stopped(child, config):
            state.running.remove(child)
            ended.append(child)
    return ended


def free_spares(state: SchedulerState, request_id: str) -> None:
    """Free the spare blocks held for a remote request's forks (under child 1's id)."""
    spare_id = child_seq_id(request_id, 1)
    if spare_id not in state.seqs and state.block_manager.has(spare_id):
        state.block_manager.free(spare_id)
