"""The engine's KV connector: prefill-only export and decode-side import of KV.

The public face of disaggregation on an LLMEngine (in the spirit of vLLM's KV connector and
SGLang's KV sender / receiver): functions over the engine's public API, all run on the thread
that drives the engine (`AsyncLLMEngine.call` / `open_stream`).

Export (prefill role):
    add_request(request with prefill_only=True)     queued; scheduled until its first token
    ready_blocks(request_id)                        blocks whose KV is final now, and whether
                                                    the request is PREFILLED (the exporter
                                                    decides when to ship them: each chunk's,
                                                    or all at once, is its policy)
    release(request_id)                             drop it in any state (blocks to the pool or
                                                    the prefix cache)
Import (decode role):
    reserve(request)                                empty blocks for the prompt's incoming KV,
                                                    the request WAITING_FOR_REMOTE_KV
    import_prefilled(request, first_tokens, ...)    the KV landed: join the running batch with
                                                    the first tokens, in one engine command
    release(request_id)                             drop it (waiting or running)

With n > 1 completions the prompt's KV still travels once: the prefill side samples the n
first tokens from the prompt's last logits row (its request forks at the final chunk), the
decode side reserves the prompt blocks once plus `n - 1` spare blocks (what the n sequences'
first decode step needs beyond one sequence's: the copies of a shared partial last block, or
a fresh block each when the prompt fills its last block), held under child 1's sequence id
and freed when `import_prefilled` forks the n sequences.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass

from kvmesh.engine.detokenizer import SequenceText
from kvmesh.engine.engine import LLMEngine
from kvmesh.engine.errors import InvalidParameterError
from kvmesh.engine.outputs import RequestOutput
from kvmesh.engine.sampler import TokenLogprobs
from kvmesh.engine.sampling_params import SamplingParams
from kvmesh.engine.scheduler import is_prefilled, stop_status, validate_request
from kvmesh.engine.sequence import Request, Sequence, SequenceStatus


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
    engine.add_built_request(request)


@dataclass(frozen=True)
class ReadyBlocks:
    """How much of a prefill-only request's KV is final now (`ready_blocks`)."""

    block_ids: list[int]  # the leading blocks of the prompt whose KV is final, logical order
    prefilled: bool  # first token sampled: `block_ids` hold the whole prompt
    preemptions: int  # a change means its blocks were freed (to be recomputed)
    computed_tokens: int  # prompt tokens whose KV is computed (chunk progress)


def ready_blocks(engine: LLMEngine, request_id: str) -> ReadyBlocks | None:
    """The blocks of a queued prefill-only request whose KV no later step changes (every full
    block its finished chunks filled; all of the prompt's once PREFILLED), or None when the
    scheduler no longer holds it (finished or released). n > 1 children share them."""
    request = engine.scheduler.get_request(request_id)
    if request is None:
        return None
    head = request.seqs[0]
    seq = parked_sequence(request) or head
    bm = engine.scheduler.block_manager
    prompt_blocks = -(-len(head.prompt_ids) // bm.block_size)
    if seq.status is SequenceStatus.PREFILLED:
        ready = prompt_blocks
    elif seq.status is SequenceStatus.RUNNING:
        ready = min(seq.num_computed_tokens // bm.block_size, prompt_blocks)
    else:
        ready = 0
    table = bm.block_table(seq.seq_id) if ready else []
    prefilled = seq.status is SequenceStatus.PREFILLED
    computed = min(seq.num_computed_tokens, len(seq.prompt_ids))
    return ReadyBlocks(table[:ready], prefilled, head.num_preemptions, computed)


def parked_sequence(request: Request) -> Sequence | None:
    """A PREFILLED sequence of the request (its table holds the prompt KV), or None."""
    return next((s for s in request.seqs if s.status is SequenceStatus.PREFILLED), None)


def release(engine: LLMEngine, request_id: str, fence: str | None = None) -> bool:
    """Drop a prefill-only request in any state (its blocks go back to the pool or the prefix
    cache); True when it was held. With `fence`, a request still waiting for its KV keeps
    its prompt blocks out of the pool under that id until `unfence(fence)`: a sender may
    still be writing into them."""
    request = engine.scheduler.get_request(request_id)
    held = request is not None
    if fence is not None and request is not None and _waits_for_kv(request):
        engine.scheduler.block_manager.fork(request.seqs[0].seq_id, fence)
    if request is not None and is_prefilled(request):
        engine.scheduler.release_prefilled(request_id)
    else:
        engine.scheduler.abort_request(request_id)
    engine.forget_request(request_id)
    return held


def _waits_for_kv(request: Request) -> bool:
    return request.seqs[0].status is SequenceStatus.WAITING_FOR_REMOTE_KV


def unfence(engine: LLMEngine, fence: str) -> None:
    """Give back the blocks `release` kept under `fence` (a no-op when it kept none)."""
    block_manager = engine.scheduler.block_manager
    if block_manager.has(fence):
        block_manager.free(fence)


def spare_blocks(n: int) -> int:
    """Blocks beyond one sequence's that `n` sequences forked from one prompt need for their
    first decode step: n - 1 (copies of the shared partial last block, or one fresh block
    each when the prompt fills its last block)."""
    return n - 1


def reserve(engine: LLMEngine, request: Request) -> list[int] | None:
    """Hold a request whose prompt KV will come from another worker: empty blocks for the
    prompt (once, whatever n) plus `spare_blocks(n)`, the request waiting for its KV (never
    scheduled) until `import_prefilled`, or `release`; the prompt's block ids, or None
    (nothing held) when the pool is short now."""
    return engine.scheduler.add_remote_request(request, spare_blocks(request.params.n))


def import_prefilled(
    engine: LLMEngine,
    request: Request,
    first_tokens: Seq[int],
    first_logprobs: Seq[TokenLogprobs | None] = (),
    *,
    kv_complete: bool = True,
) -> RequestOutput:
    """Join a request whose prompt KV sits in its reserved blocks as its n completions
    (`first_tokens[i]` is completion i's); returns the output carrying the first tokens
    (finished when they already end every completion). `kv_complete=False` (no KV came: the
    producer's request ended at its first token) is accepted only when the first tokens end
    every completion (InvalidParameterError naming `first_tokens` otherwise)."""
    if not kv_complete and not first_tokens_finish(engine, request, first_tokens):
        raise InvalidParameterError(
            "first_tokens", "no KV came with them, yet they do not end every completion"
        )
    num_prompt = len(request.seqs[0].prompt_ids)
    engine.scheduler.add_prefilled_request(
        request, num_prompt, first_tokens, kv_written=kv_complete
    )
    return engine.emit_imported(request, first_logprobs)


def first_tokens_finish(engine: LLMEngine, request: Request, first_tokens: Seq[int]) -> bool:
    """Whether the first tokens alone end every completion (stop id, EOS, length or stop
    string).

    Such a request needs no KV on the decode side; the prefill side cannot ship it either,
    because its blocks were freed the moment the last of its completions ended.
    """
    return all(_first_token_finishes(engine, request, token) for token in first_tokens)


def _first_token_finishes(engine: LLMEngine, request: Request, first_token: int) -> bool:
    seq = Request.from_prompt("probe", request.seqs[0].prompt_ids, request.params).seqs[0]
    seq.append_token(first_token)
    config = engine.scheduler.config
    if stop_status(seq, config.eos_token_ids, config.max_model_len) is not None:
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
        params.min_tokens,
    )
    text.append([first_token])
    return text.stopped_by is not None
