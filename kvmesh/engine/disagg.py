"""Disaggregation on an LLMEngine: prefill-only export and decode-side import of KV.

Functions, not methods, so the engine core stays as it is; all of them must run on the thread
that drives the engine (they touch the scheduler and the block manager).

Prefill role:  add_request(..., prefill_only=True) → step until PREFILLED
               → prefilled_block_ids → ship the KV → release_prefilled
Decode role:   reserve_blocks (empty blocks for the prompt) → KV lands in them
               → join_prefilled (joins the running batch with the first token)
               or free_reservation when the KV never came.
"""

from __future__ import annotations

import time
from collections.abc import Sequence as Seq

from kvmesh.engine.detokenizer import SequenceText
from kvmesh.engine.engine import LLMEngine, _Tracked
from kvmesh.engine.errors import InvalidParameterError
from kvmesh.engine.outputs import RequestMetrics, RequestOutput
from kvmesh.engine.sampler import TokenLogprobs
from kvmesh.engine.sampling_params import SamplingParams
from kvmesh.engine.scheduler_stops import stop_status, validate_request
from kvmesh.engine.sequence import Request, SequenceStatus


def build_request(
    engine: LLMEngine,
    request_id: str,
    prompt_ids: Seq[int],
    params: SamplingParams,
    *,
    extra_key: bytes | None = None,
    prefill_only: bool = False,
) -> Request:
    """A validated Request (InvalidParameterError names the field); nothing is queued."""
    ids, _ = engine.encode_prompt(list(prompt_ids))
    params.validate_for_model(engine.runner.vocab_size)
    request = Request.from_prompt(
        request_id, ids, params, extra_key=extra_key or None, prefill_only=prefill_only
    )
    scheduler = engine.scheduler
    bm = scheduler.block_manager
    validate_request(request, scheduler.config, bm.num_blocks, bm.block_size)
    return request


def add_request(engine: LLMEngine, request: Request) -> None:
    """Queue a built request (like LLMEngine.add_request, but keeping its prefix-cache salt)."""
    engine.scheduler.add_request(request)
    _track(engine, request)


def prefilled_block_ids(engine: LLMEngine, request_id: str) -> list[int]:
    """Block ids holding a PREFILLED request's prompt KV, in logical order."""
    request = engine.scheduler.get_request(request_id)
    if request is None or request.seqs[0].status is not SequenceStatus.PREFILLED:
        raise InvalidParameterError("request_id", f"{request_id!r} is not prefilled")
    return engine.scheduler.block_manager.block_table(request.seqs[0].seq_id)


def release_prefilled(engine: LLMEngine, request_id: str) -> bool:
    """Drop a prefill-only request in any state (its blocks go back to the pool or the prefix
    cache); True when it was held."""
    request = engine.scheduler.get_request(request_id)
    held = request is not None
    if request is not None and all(s.status is SequenceStatus.PREFILLED for s in request.seqs):
        engine.scheduler.release_prefilled(request_id)
    else:
        engine.scheduler.abort_request(request_id)
    _forget(engine, request_id)
    return held


def reserve_blocks(engine: LLMEngine, seq_id: str, num_tokens: int) -> list[int] | None:
    """Allocate empty blocks for `num_tokens` prompt tokens; None when the pool is short now."""
    bm = engine.scheduler.block_manager
    if bm.has(seq_id):
        raise InvalidParameterError("request_id", f"{seq_id!r} already holds blocks")
    if bm.allocate(seq_id, num_tokens) is None:
        return None
    return bm.block_table(seq_id)


def free_reservation(engine: LLMEngine, seq_id: str) -> bool:
    """Free reserved blocks that never joined the batch; True when there were any."""
    bm = engine.scheduler.block_manager
    if engine.scheduler.get_request(seq_id) is not None or not bm.has(seq_id):
        return False
    bm.free(seq_id)
    return True


def join_prefilled(
    engine: LLMEngine,
    request: Request,
    first_token: int,
    first_logprobs: TokenLogprobs | None = None,
) -> RequestOutput:
    """Join a request whose prompt KV sits in its reserved blocks; returns the output carrying
    the first token (finished when that token already ends it)."""
    num_prompt = len(request.seqs[0].prompt_ids)
    engine.scheduler.add_prefilled_request(request, num_prompt, first_token)
    tracked = _track(engine, request)
    seq = request.seqs[0]
    if first_logprobs is not None:
        engine._step_logprobs[seq.seq_id] = first_logprobs
    try:
        engine._record_token(tracked, seq, time.monotonic())
    finally:
        engine._step_logprobs.pop(seq.seq_id, None)
    return engine._emit(tracked)


def first_token_finishes(engine: LLMEngine, request: Request, first_token: int) -> bool:
    """Whether `first_token` alone ends the request (stop id, EOS, length or stop string).

    Such a request needs no KV on the decode side; the prefill side cannot ship it either,
    because its blocks were freed the moment the token ended it.
    """
    seq = Request.from_prompt("probe", request.seqs[0].prompt_ids, request.params).seqs[0]
    seq.append_token(first_token)
    config = engine.scheduler.config
    if stop_status(seq, config.eos_token_id, config.max_model_len) is not None:
        return True
    params = request.params
    stops = (params.stop,) if isinstance(params.stop, str) else tuple(params.stop)
    if not stops:
        return False
    text = SequenceText(
        engine.tokenizer,
        seq.prompt_ids,
        stops,
        params.include_stop_str_in_output,
        params.skip_special_tokens,
    )
    text.append([first_token])
    return text.stopped_by is not None


def _track(engine: LLMEngine, request: Request) -> _Tracked:
    tracked = _Tracked(request, None, metrics=RequestMetrics(request.arrival_time))
    engine._tracked[request.request_id] = tracked
    engine._seq_request[request.request_id] = request.request_id
    return tracked


def _forget(engine: LLMEngine, request_id: str) -> None:
    tracked = engine._tracked.pop(request_id, None)
    if tracked is not None:
        for seq in tracked.request.seqs:
            engine._seq_request.pop(seq.seq_id, None)
