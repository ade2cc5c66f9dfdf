"""Protobuf ⇄ engine conversion for the worker services (protobuf stops here).

Unset optional sampling fields take the engine's defaults; set ones are validated by the
engine's own rules (`InvalidParameterError` names the field).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from kvmesh.engine.outputs import CompletionOutput, RequestOutput
from kvmesh.engine.sampler import TokenLogprobs
from kvmesh.engine.sampling_params import SamplingParams
from kvmesh.models.token_bytes import token_bytes
from kvmesh.v1 import generation_pb2, worker_pb2

_OPTIONAL_SAMPLING = (
    "n",
    "temperature",
    "top_k",
    "top_p",
    "min_p",
    "seed",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "max_tokens",
    "min_tokens",
    "ignore_eos",
    "logprobs",
    "include_stop_str_in_output",
    "skip_special_tokens",
    "prompt_logprobs",
)
MAX_TOKENS_UP_TO_CONTEXT = -1  # sampling.max_tokens: no bound but the model's context
FINISH_REASONS = {
    None: generation_pb2.FINISH_REASON_UNSPECIFIED,
    "stop": generation_pb2.FINISH_REASON_STOP,
    "length": generation_pb2.FINISH_REASON_LENGTH,
    "abort": generation_pb2.FINISH_REASON_ABORT,
}


def with_defaults(
    message: generation_pb2.SamplingParams, defaults: Mapping[str, Any]
) -> generation_pb2.SamplingParams:
    """`message` with the model's default sampling (`kvmesh.engine.generation_defaults`) in
    the fields it leaves unset; its `max_new_tokens` (here `max_tokens`) bounds an open-ended
    request (max_tokens -1), as vLLM bounds a request without a length (the engine ends any
    request at the context, so the least of the two applies)."""
    if not defaults:
        return message
    resolved = generation_pb2.SamplingParams()
    resolved.CopyFrom(message)
    for name, value in defaults.items():
        if name == "max_tokens":
            if message.HasField("max_tokens") and message.max_tokens == MAX_TOKENS_UP_TO_CONTEXT:
                resolved.max_tokens = value
        elif not message.HasField(name):
            setattr(resolved, name, value)
    return resolved


def sampling_from_proto(message: generation_pb2.SamplingParams) -> SamplingParams:
    """Engine SamplingParams from the proto (unset fields: the engine's defaults; apply the
    model's first with `with_defaults`); raises InvalidParameterError naming the field.
    max_tokens -1 is the engine's None: generate until the model's maximum length."""
    kwargs: dict[str, Any] = {
        name: getattr(message, name) for name in _OPTIONAL_SAMPLING if message.HasField(name)
    }
    if kwargs.get("max_tokens") == MAX_TOKENS_UP_TO_CONTEXT:
        kwargs["max_tokens"] = None
    if message.stop_token_ids:
        kwargs["stop_token_ids"] = tuple(message.stop_token_ids)
    if message.stop:
        kwargs["stop"] = tuple(message.stop)
    if message.logit_bias:
        kwargs["logit_bias"] = dict(message.logit_bias)
    return SamplingParams(**kwargs)


def token_texts(tokenizer: Any, ids: Sequence[int]) -> list[str]:
    """Each token decoded alone, special tokens kept (a partial UTF-8 character reads as
    U+FFFD); empty strings without a tokenizer."""
    if tokenizer is None:
        return [""] * len(ids)
    return [str(tokenizer.decode([i], skip_special_tokens=False)) for i in ids]


def logprobs_to_proto(item: TokenLogprobs, tokenizer: Any = None) -> generation_pb2.TokenLogprobs:
    """The wire form; with a tokenizer, `token` / `top_tokens` carry the tokens' text and
    `token_bytes` / `top_token_bytes` their own bytes."""
    ids = [item.sampled_token_id, *item.top_token_ids]
    texts, raw = token_texts(tokenizer, ids), token_bytes(tokenizer, ids)
    return generation_pb2.TokenLogprobs(
        token_id=item.sampled_token_id,
        logprob=item.sampled_logprob,
        top_token_ids=list(item.top_token_ids),
        top_logprobs=list(item.top_logprobs),
        token=texts[0],
        top_tokens=texts[1:],
        rank=item.sampled_rank,
        token_bytes=raw[0],
        top_token_bytes=raw[1:],
    )


def logprobs_from_proto(message: generation_pb2.TokenLogprobs) -> TokenLogprobs:
    """The wire form's rank is 0 when unknown."""
    return TokenLogprobs(
        sampled_token_id=message.token_id,
        sampled_logprob=message.logprob,
        sampled_rank=message.rank,
        top_token_ids=tuple(message.top_token_ids),
        top_logprobs=tuple(message.top_logprobs),
    )


def completion_response(
    out: CompletionOutput, cached_tokens: int, tokenizer: Any = None
) -> worker_pb2.DecodeResponse:
    """The delta of one completion since its previous output (new ids, text, logprobs; token
    text in the logprobs when `tokenizer` is given)."""
    new = out.new_token_ids
    response = worker_pb2.DecodeResponse(index=out.index, token_ids=new, text=out.new_text)
    if out.logprobs and new:
        response.logprobs.extend(
            logprobs_to_proto(lp, tokenizer) for lp in out.logprobs[-len(new) :]
        )
    if out.finish_reason is not None:
        response.finish_reason = FINISH_REASONS.get(
            out.finish_reason, generation_pb2.FINISH_REASON_UNSPECIFIED
        )
        response.completion_tokens = len(out.token_ids)
        response.cached_tokens = cached_tokens
        if isinstance(out.stop_reason, str):
            response.stop_string = out.stop_reason
        elif isinstance(out.stop_reason, int):
            response.stop_token_id = out.stop_reason
    return response


def decode_responses(
    output: RequestOutput, tokenizer: Any = None
) -> list[worker_pb2.DecodeResponse]:
    """Responses for every completion that changed in `output`: new tokens or text, or its
    finish (sent once: a completion that finished earlier is left out of later outputs)."""
    return [
        completion_response(out, output.num_cached_tokens, tokenizer)
        for out in output.outputs
        if out.new_token_ids or out.new_text or out.new_finish
    ]


def add_prompt_scores(
    message: worker_pb2.DecodeResponse | worker_pb2.PrefillResponse,
    output: RequestOutput,
    tokenizer: Any = None,
) -> None:
    """Put a request's prompt logprobs and decoded prompt text into `message` (a colocated
    worker's first response, or the prefill answer the control plane relays), when the request
    computed them: one entry per prompt token, the first carrying only its token (logprob
    NaN); the text as the tokenizer decodes the ids (special tokens kept), empty without one."""
    entries = output.prompt_logprobs
    if entries is None or not output.prompt_token_ids:
        return
    first_id = output.prompt_token_ids[0]
    first = generation_pb2.TokenLogprobs(
        token_id=first_id,
        logprob=math.nan,
        token=token_texts(tokenizer, [first_id])[0],
        token_bytes=token_bytes(tokenizer, [first_id])[0],
    )
    rest = [logprobs_to_proto(entry, tokenizer) for entry in entries[1:] if entry is not None]
    message.prompt_logprobs.extend([first, *rest])
    if tokenizer is not None:
        ids = output.prompt_token_ids
        message.prompt_text = str(tokenizer.decode(ids, skip_special_tokens=False))


def first_tokens(output: RequestOutput, tokenizer: Any = None) -> list[worker_pb2.FirstToken]:
    """The first token of every completion of a prefilled request."""
    result = []
    for out in output.outputs:
        first = worker_pb2.FirstToken(index=out.index, token_id=out.token_ids[0])
        if out.logprobs:
            first.logprobs.CopyFrom(logprobs_to_proto(out.logprobs[0], tokenizer))
        result.append(first)
    return result
