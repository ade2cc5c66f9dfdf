"""Request admission checks and token-based stop rules (pure functions of a sequence)."""

from __future__ import annotations

from collections.abc import Collection
from collections.abc import Sequence as Seq
from typing import TYPE_CHECKING

from kvmesh.engine.errors import EmptyPromptError, InvalidParameterError, PromptTooLongError
from kvmesh.engine.scheduler.config import SchedulerConfig
from kvmesh.engine.sequence import CHILD_SEPARATOR, Request, Sequence

if TYPE_CHECKING:
    from kvmesh.engine.sampling_params import SamplingParams
    from kvmesh.memory import BlockManager


def max_total_tokens(params: SamplingParams, num_prompt_tokens: int, max_model_len: int) -> int:
    """Most tokens (prompt + output) one sequence of the request can ever hold."""
    max_tokens = params.max_tokens
    if max_tokens is None:
        return max_model_len
    return min(num_prompt_tokens + max_tokens, max_model_len)


def max_kv_slots(params: SamplingParams, num_prompt_tokens: int, max_model_len: int) -> int:
    """Most KV slots one sequence of the request can ever write: every token of
    `max_total_tokens` but the last sampled one, which ends the sequence unwritten (the whole
    prompt at least)."""
    total = max_total_tokens(params, num_prompt_tokens, max_model_len)
    return max(num_prompt_tokens, total - 1)


def validate_request(
    request: Request, config: SchedulerConfig, num_blocks: int, block_size: int
) -> None:
    """Raise InvalidParameterError (naming the field) for a request that can never run."""
    check_request_id(request.request_id)
    if len(request.seqs) != 1:
        raise InvalidParameterError(
            "seqs", f"a new request has one sequence, got {len(request.seqs)}"
        )
    seq = request.seqs[0]
    num_prompt = seq.num_tokens
    if num_prompt == 0:
        raise EmptyPromptError()
    if num_prompt > config.max_model_len:
        raise PromptTooLongError(num_prompt, config.max_model_len)
    check_prompt_logprobs(request.params.prompt_logprobs, num_prompt)
    max_tokens = request.params.max_tokens
    if max_tokens is not None and max_tokens > config.max_model_len:
        raise PromptTooLongError(max_tokens, config.max_model_len, field="max_tokens")
    # a max_tokens the prompt leaves no room for runs up to the context and ends "length"
    # (`max_total_tokens`, `stop_status`), as vLLM takes the least of the two
    slots = max_kv_slots(request.params, num_prompt, config.max_model_len)
    needed = -(-slots // block_size)
    if needed > num_blocks:
        raise InvalidParameterError(
            "max_tokens",
            f"prompt + max_tokens write {slots} KV slots (the last sampled token's KV is never"
            f" written): {needed} blocks of {block_size}, but the pool holds only {num_blocks}",
        )
    if request.params.n > 1 and config.allocation == "contiguous":
        raise InvalidParameterError("n", "parallel sampling needs allocation='paged'")


def check_request_id(request_id: str) -> None:
    """InvalidParameterError naming request_id when it contains the child separator: such an
    id could equal a sequence id of another request's n > 1 children."""
    if CHILD_SEPARATOR in request_id:
        raise InvalidParameterError(
            "request_id",
            f"{request_id!r} contains {CHILD_SEPARATOR!r}, reserved for the ids of a request's"
            " parallel samples",
        )


MAX_PROMPT_LOGPROB_ENTRIES = 1 << 17
"""Prompt tokens x (prompt_logprobs + 1) a request may ask for: at most 2.9 MB on the wire (16-22
bytes a value, BENCHMARKS.md "Prompt logprobs on the wire"), inside gRPC's default 4 MiB message
on every hop, so a long prompt is refused before its prefill rather than failing after it."""


def check_prompt_logprobs(top: int | None, num_prompt: int) -> None:
    """InvalidParameterError naming prompt_logprobs when the prompt's entries would not fit."""
    if top is not None and num_prompt * (top + 1) > MAX_PROMPT_LOGPROB_ENTRIES:
        raise InvalidParameterError(
            "prompt_logprobs",
            f"{num_prompt} prompt tokens x {top + 1} values exceed {MAX_PROMPT_LOGPROB_ENTRIES} "
            "in one answer; ask for fewer alternatives or a shorter prompt",
        )


def validate_import(
    seq: Sequence, num_computed: int, first_tokens: Seq[int], block_manager: BlockManager
) -> None:
    """InvalidParameterError naming the argument of a prefilled import that does not fit `seq`."""
    if num_computed != seq.num_tokens:
        raise InvalidParameterError(
            "num_computed_tokens",
            f"must equal the prompt length {seq.num_tokens}, got {num_computed}",
        )
    if len(first_tokens) != seq.params.n:
        raise InvalidParameterError(
            "first_tokens", f"expected n = {seq.params.n} tokens, got {len(first_tokens)}"
        )
    held = block_manager.num_tokens(seq.seq_id)
    if held < num_computed:
        raise InvalidParameterError(
            "num_computed_tokens", f"{num_computed} exceeds the {held} slots allocated"
        )


def prepare_stop_check(seq: Sequence, config: SchedulerConfig) -> None:
    """Precompute what `stop_status` needs to be consulted: a token set and a length limit."""
    params = seq.params
    seq.token_limit = max_total_tokens(params, seq.num_prompt_tokens, config.max_model_len)
    stops = set(params.stop_token_ids or ())
    if not params.ignore_eos:
        stops.update(config.eos_token_ids)
    seq.stop_token_set = frozenset(stops)


def stop_status(
    seq: Sequence, eos_token_ids: Collection[int], max_model_len: int
) -> tuple[str, int | None] | None:
    """(finish_reason, stop_reason) if `seq`'s last token ends it, else None.

    Any of the model's EOS ids (stop_reason None; not with ignore_eos) and stop_token_ids
    (stop_reason the id) count only after min_tokens outputs; max_tokens and max_model_len end
    with "length".
    """
    params = seq.params
    num_output = len(seq.output_ids)
    token = seq.last_token_id
    if num_output >= (params.min_tokens or 0):
        if token in eos_token_ids and not params.ignore_eos:
            return "stop", None
        stop_ids = params.stop_token_ids
        if stop_ids and token in stop_ids:
            return "stop", token
    if params.max_tokens is not None and num_output >= params.max_tokens:
        return "length", None
    if seq.num_tokens >= max_model_len:
        return "length", None
    return None
