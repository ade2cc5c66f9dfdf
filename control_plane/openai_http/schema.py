"""OpenAI request bodies → GenerateRequest, validated by hand.

Unknown fields are ignored (as OpenAI-compatible servers do); a known field of the wrong type or
out of range is an ApiError 400 naming it. Model-dependent checks (vocabulary, context length,
stop-string limits) stay with the prefill worker, whose errors name the same fields.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import grpc

from control_plane.limits import RequestLimits
from control_plane.openai_http.errors import ApiError, bad_param, from_failure
from control_plane.run import MAX_TOKENS_UP_TO_CONTEXT, RpcFailure
from control_plane.validation import (
    DEFAULT_LIMITS,
    MAX_TEMPLATE_KWARGS_BYTES,
    FieldError,
    check_sampling,
)
from kvmesh.v1 import generation_pb2

Kind = Literal["completion", "chat"]
MAX_N = 128
MAX_CHOICES = 256  # prompts x n of one completions request
MAX_TOP_LOGPROBS = 20
SEED_LIMIT = 2**63  # seeds are int64 in OpenAI's and vLLM's API; the workers take [0, 2**63)
_TYPES: dict[str, tuple[type, ...]] = {
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
    "string": (str,),
    "array": (list,),
    "object": (dict,),
}
# param -> (JSON type, range check or None, what the range is); same names in SamplingParams.
_SAMPLING: dict[str, tuple[str, Callable[[Any], bool] | None, str]] = {
    "temperature": ("number", lambda v: 0 <= v <= 2, "in [0, 2]"),
    "top_p": ("number", lambda v: 0 < v <= 1, "in (0, 1]"),
    "presence_penalty": ("number", lambda v: -2 <= v <= 2, "in [-2, 2]"),
    "frequency_penalty": ("number", lambda v: -2 <= v <= 2, "in [-2, 2]"),
    "seed": ("integer", lambda v: -SEED_LIMIT <= v < SEED_LIMIT, "in [-2**63, 2**63)"),
    "top_k": ("integer", lambda v: v >= -1, ">= -1"),
    "min_p": ("number", lambda v: 0 <= v <= 1, "in [0, 1]"),
    "repetition_penalty": ("number", lambda v: v > 0, "> 0"),
    "min_tokens": ("integer", lambda v: v >= 0, ">= 0"),
    "ignore_eos": ("boolean", None, ""),
    "include_stop_str_in_output": ("boolean", None, ""),
    "skip_special_tokens": ("boolean", None, ""),
}
# param -> its value on the wire, where that differs: a negative seed is folded into the
# workers' [0, 2**63) as its low 63 bits (the same seed, the same draws; >= 0 stays as it is).
_WIRE: dict[str, Callable[[Any], Any]] = {"seed": lambda v: v % SEED_LIMIT}
TOKEN_ID_LIMIT = 2**31  # token ids travel as int32
# Fields of OpenAI's or vLLM's API that would change the answer and are not implemented:
# param -> whether a value changes nothing (null always does). Any other value is a 400.
_ANY_VALUE = ("guided_json", "guided_regex", "guided_choice", "guided_grammar",
              "structured_outputs", "truncate_prompt_tokens", "audio", "chat_template")  # fmt: skip
_UNLESS_FALSE = ("use_beam_search", "return_tokens_as_token_ids", "return_token_ids")
_UNIMPLEMENTED: dict[str, Callable[[Any], bool]] = {
    **{name: lambda v: False for name in _ANY_VALUE},
    **{name: lambda v: v is False for name in _UNLESS_FALSE},
    "allowed_token_ids": lambda v: v == [],
    "logits_processors": lambda v: v == [],  # vLLM's, refused unless its server allows them
    "priority": lambda v: v == 0,  # vLLM's, refused unless priority scheduling is on (FCFS here)
    "bad_words": lambda v: v == [],
    "logprob_token_ids": lambda v: v == [],
    "thinking_token_budget": lambda v: v == -1,  # vLLM's "unlimited", as unset
    "repetition_detection": lambda v: isinstance(v, dict) and not v.get("max_pattern_size"),
    "tool_choice": lambda v: v in ("none", "auto"),
    "modalities": lambda v: v == ["text"],
}
# Why a field is refused, where "is not supported" would not say it.
_UNTRUSTED_TEMPLATE = (
    "a chat template given with the request is not trusted (vLLM serves one only when started "
    "with --trust-request-chat-template; kvmesh has no such flag): the model's own template "
    "renders every conversation"
)
_REFUSED_WHY = {"chat_template": _UNTRUSTED_TEMPLATE}
# A message's fields (by its role; `task` of any) that vLLM passes to the chat template.
_TEMPLATE_FIELDS = {
    "assistant": ("reasoning", "reasoning_content"),
    "tool": ("tool_call_id",),
    "developer": ("tools",),
}
_UNIMPLEMENTED_FOR: dict[Kind, dict[str, Callable[[Any], bool]]] = {
    "completion": {
        "prompt_embeds": lambda v: False,
    },
    "chat": {
        "echo": lambda v: v is False,
        # vLLM's chat template variable (it sets enable_thinking too)
        "reasoning_effort": lambda v: False,
        "return_prompt_text": lambda v: v is False,
    },
}


@dataclass(frozen=True)
class ParsedRequest:
    """One OpenAI request: a GenerateRequest per prompt (request ids unset; chat has one, a
    completions `prompt` may be a batch) and how to answer it."""

    kind: Kind
    model: str | None
    requests: tuple[generation_pb2.GenerateRequest, ...]
    stream: bool
    include_usage: bool
    logprobs: int | None  # top alternatives per token when logprobs were asked for, else None
    user: str | None
    echo: bool = False  # completions: each choice starts with its prompt (and its logprobs)
    prompt_only: bool = False  # echo with max_tokens 0: the prompt alone, nothing generated
    prompt_logprobs: int | None = None  # vLLM's field: the prompt's logprobs in the answer
    max_tokens_param: str = "max_tokens"  # the body's name for it (chat: max_completion_tokens)
    continuous_usage: bool = False  # usage on every chunk (include_usage + continuous_usage_stats)

    @property
    def request(self) -> generation_pb2.GenerateRequest:
        """The first prompt's request (the only one but for a batch of completions)."""
        return self.requests[0]

    @property
    def n(self) -> int:
        """Choices per prompt."""
        return self.requests[0].sampling.n or 1


def field(
    body: dict[str, Any], name: str, kind: str, default: Any = None, *, within: str = ""
) -> Any:
    """body[name] checked against a JSON type (null or absent → default); a refusal names
    the field as `within.name` when `body` is the object of field `within`."""
    value = body.get(name)
    if value is None:
        return default
    ok = isinstance(value, _TYPES[kind]) and (kind == "boolean" or not isinstance(value, bool))
    if not ok:
        param = f"{within}.{name}" if within else name
        raise bad_param(param, f"expected {kind}, got {type(value).__name__}")
    return value


def parse(body: Any, kind: Kind, limits: RequestLimits = DEFAULT_LIMITS) -> ParsedRequest:
    """The ParsedRequest of a decoded JSON body (ApiError 400 naming the bad param);
    `limits`: the front door's, which a batch's shared sampling meets before it is copied."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    refuse_unimplemented(body, kind)
    echo = kind == "completion" and field(body, "echo", "boolean", False)
    prompt_only = echo and type(body.get("max_tokens")) is int and body["max_tokens"] == 0
    request = generation_pb2.GenerateRequest(
        sampling=sampling(body, kind, prompt_only), cache_salt=cache_salt(body)
    )
    if kind == "completion":
        requests = completion_requests(body, request, limits)
    else:
        request.chat.CopyFrom(chat_messages(body, documents=True))
        requests = (request,)
    logprobs = completion_logprobs(body) if kind == "completion" else chat_logprobs(body)
    prompt_logprobs = field(body, "prompt_logprobs", "integer")
    if prompt_logprobs is not None and not 0 <= prompt_logprobs <= MAX_TOP_LOGPROBS:
        raise bad_param(
            "prompt_logprobs", f"must be in [0, {MAX_TOP_LOGPROBS}], got {prompt_logprobs}"
        )
    for each in requests:
        if logprobs is not None:
            each.sampling.logprobs = logprobs
        if echo and (logprobs is not None or each.WhichOneof("prompt") != "text"):
            # the prompt's logprobs, or the text of a token prompt, come from the worker
            each.sampling.prompt_logprobs = logprobs or 0
        if prompt_logprobs is not None:
            each.sampling.prompt_logprobs = max(prompt_logprobs, each.sampling.prompt_logprobs)
    stream = field(body, "stream", "boolean", False)
    options = field(body, "stream_options", "object", {})
    if options and not stream:  # as OpenAI and vLLM answer
        raise bad_param("stream_options", "is allowed only when stream is true")
    include_usage = field(options, "include_usage", "boolean", False, within="stream_options")
    continuous = field(  # vLLM's option
        options, "continuous_usage_stats", "boolean", False, within="stream_options"
    )
    return ParsedRequest(
        kind, field(body, "model", "string"), requests, stream, include_usage, logprobs,
        field(body, "user", "string"), echo, prompt_only, prompt_logprobs,
        max_tokens_name(body, kind), include_usage and continuous,
    )  # fmt: skip


def refuse_unimplemented(body: dict[str, Any], kind: Kind) -> None:
    """A 400 naming the first field the server does not implement that is set to a value
    which would change the answer (`_UNIMPLEMENTED`, `_UNIMPLEMENTED_FOR`), or a
    `response_format` other than text (either endpoint: vLLM constrains completions too)."""
    for name, changes_nothing in {**_UNIMPLEMENTED, **_UNIMPLEMENTED_FOR[kind]}.items():
        value = body.get(name)
        if value is not None and not changes_nothing(value):
            raise bad_param(name, _REFUSED_WHY.get(name, "is not supported"))
    response_format = field(body, "response_format", "object", {})
    if response_format.get("type", "text") != "text":
        raise bad_param("response_format", "only type 'text' is supported")


def cache_salt(body: dict[str, Any]) -> bytes:
    """vLLM's `cache_salt` (UTF-8) as the request's prefix-cache salt: requests of different
    salts never share KV blocks; absent or null, the request shares with every unsalted one.
    400 unless a non-empty string (as vLLM answers); the front door bounds its length."""
    salt = field(body, "cache_salt", "string")
    if salt is None:
        return b""
    if not salt:
        raise bad_param("cache_salt", "must be a non-empty string")
    return salt.encode()


def max_tokens_name(body: dict[str, Any], kind: Kind) -> str:
    """The body's field for the completion length: chat's max_completion_tokens when given
    (it wins over the older max_tokens), else max_tokens."""
    if kind == "chat" and body.get("max_completion_tokens") is not None:
        return "max_completion_tokens"
    return "max_tokens"


def sampling(
    body: dict[str, Any], kind: Kind, prompt_only: bool = False
) -> generation_pb2.SamplingParams:
    """The sampling fields; `prompt_only` (echo with max_tokens 0) generates one token, which
    the answer leaves out. Without a length, completions generate OpenAI's default of 16
    tokens (the workers' default), chat up to the model's context (max_tokens -1)."""
    params = generation_pb2.SamplingParams()
    for name, (json_type, check, what) in _SAMPLING.items():
        value = field(body, name, json_type)
        if value is None:
            continue
        if check is not None and not check(value):
            raise bad_param(name, f"must be {what}, got {value}")
        try:
            setattr(params, name, _WIRE[name](value) if name in _WIRE else value)
        except (ValueError, OverflowError):  # beyond the wire type (int32, or a float's range)
            raise bad_param(name, f"is out of range: {value}") from None
    max_length(body, kind, prompt_only, params)
    n = field(body, "n", "integer", 1)
    if not 1 <= n <= MAX_N:
        raise bad_param("n", f"must be in [1, {MAX_N}], got {n}")
    params.n = n
    params.stop.extend(stop_strings(body))
    params.stop_token_ids.extend(stop_token_ids(body))
    params.logit_bias.update(logit_bias(body))
    return params


def max_length(
    body: dict[str, Any], kind: Kind, prompt_only: bool, params: generation_pb2.SamplingParams
) -> None:
    """params.max_tokens from the body's max_tokens (chat: max_completion_tokens), 400 naming
    the field the body used; unset for a completion without one or with null (OpenAI's 16, as
    vLLM's `normalize_null_max_tokens` reads null), -1 for such a chat (vLLM: up to the
    context, or the model's max_new_tokens)."""
    name = max_tokens_name(body, kind)
    max_tokens = field(body, name, "integer")
    if prompt_only:
        max_tokens = 1
    if max_tokens is None:
        if kind == "chat":
            params.max_tokens = MAX_TOKENS_UP_TO_CONTEXT
        return
    if max_tokens < 1:
        why = " (0 only with echo)" if kind == "completion" else ""
        raise bad_param(name, f"must be >= 1{why}, got {max_tokens}")
    try:
        params.max_tokens = max_tokens
    except ValueError:  # beyond int32
        raise bad_param(name, f"is out of range: {max_tokens}") from None


def stop_token_ids(body: dict[str, Any]) -> list[int]:
    """vLLM's `stop_token_ids`: token ids in [0, 2**31) that end a completion (the vocabulary
    and how many are the workers' and the front door's bounds)."""
    ids = field(body, "stop_token_ids", "array", [])
    if not all(is_token_id(t) for t in ids):
        raise bad_param("stop_token_ids", f"expected token ids in [0, {TOKEN_ID_LIMIT})")
    return ids  # type: ignore[no-any-return]


def logit_bias(body: dict[str, Any]) -> dict[int, float]:
    """OpenAI's `logit_bias`: token ids (as JSON object keys: decimal strings) to biases in
    [-100, 100]. How many is the front door's bound (`--max-logit-bias-tokens`), the
    vocabulary the worker's."""
    bias = field(body, "logit_bias", "object", {})
    out: dict[int, float] = {}
    for key, value in bias.items():
        digits = isinstance(key, str) and key.isascii() and key.isdecimal() and len(key) <= 10
        if not digits or int(key) >= 2**31:
            raise bad_param("logit_bias", f"keys must be token ids below 2**31, got {key!r}")
        token_id = int(key)
        if token_id in out:
            raise bad_param("logit_bias", f"token id {token_id} is given twice")
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        if not ok or not -100 <= value <= 100:
            raise bad_param("logit_bias", f"token {key}: a bias in [-100, 100], got {value!r}")
        out[token_id] = float(value)
    return out


def stop_strings(body: dict[str, Any]) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    items = [stop] if isinstance(stop, str) else stop
    if not isinstance(items, list) or not all(isinstance(s, str) and s for s in items):
        raise bad_param("stop", "expected a non-empty string or a list of them")
    return items


def completion_requests(
    body: dict[str, Any],
    request: generation_pb2.GenerateRequest,
    limits: RequestLimits = DEFAULT_LIMITS,
) -> tuple[generation_pb2.GenerateRequest, ...]:
    """One request per prompt of `prompt` (a string, a token list, or a batch of either: up
    to MAX_CHOICES choices in all), after the fields only completions have. A batch's sampling
    (stop lists, logit bias: as large as the body) meets the front door's `limits` before each
    prompt gets its copy, so a body cannot claim hundreds of times its size."""
    completion_only(body, request)
    prompts = prompt_batch(body.get("prompt"))
    if len(prompts) * request.sampling.n > MAX_CHOICES:
        raise bad_param(
            "prompt", f"{len(prompts)} prompts x n={request.sampling.n} choices exceed "
            f"{MAX_CHOICES} in one request",
        )  # fmt: skip
    if len(prompts) > 1:
        try:
            check_sampling(request.sampling, limits)
        except FieldError as error:  # answered as the run's own check would answer it
            failure = RpcFailure(grpc.StatusCode.INVALID_ARGUMENT, str(error), field=error.field)
            raise from_failure(failure) from None
    requests = []
    for prompt in prompts:
        each = generation_pb2.GenerateRequest()
        each.CopyFrom(request)
        if isinstance(prompt, str):
            each.text = prompt
        else:
            each.token_ids.ids.extend(prompt)
        requests.append(each)
    return tuple(requests)


def prompt_batch(prompt: Any) -> list[str | list[int]]:
    """`prompt` as a list of prompts: one string or token list, or a batch (a list of
    strings or of token lists); token ids are ints in [0, 2**31). ApiError naming `prompt` or
    the bad `prompt[i]`."""
    if (isinstance(prompt, str) and prompt) or is_token_list(prompt):
        return [prompt]
    batch = isinstance(prompt, list) and prompt and all(isinstance(p, str | list) for p in prompt)
    if not batch:
        raise bad_param("prompt", "expected a non-empty string, a list of token ids (each "
                        f"in [0, {TOKEN_ID_LIMIT})), or a list of either")  # fmt: skip
    for i, each in enumerate(prompt):
        if not ((isinstance(each, str) and each) or is_token_list(each)):
            raise bad_param(f"prompt[{i}]", "expected a non-empty string or list of token ids "
                            f"(each in [0, {TOKEN_ID_LIMIT}))")  # fmt: skip
    return list(prompt)


def completion_only(body: dict[str, Any], request: generation_pb2.GenerateRequest) -> None:
    """The fields only completions have (vLLM's `add_special_tokens`: false tokenizes a text
    prompt without the tokenizer's special tokens, e.g. its BOS)."""
    special = field(body, "add_special_tokens", "boolean")
    if special is not None:
        request.add_special_tokens = special
    if field(body, "suffix", "string"):
        raise bad_param("suffix", "is not supported")
    best_of = field(body, "best_of", "integer")
    if best_of is not None and best_of != request.sampling.n:
        raise bad_param("best_of", "must equal n (or be omitted)")


def is_token_id(value: Any) -> bool:
    """An int (not a bool) in [0, 2**31): what the wire's int32 token ids can carry."""
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < TOKEN_ID_LIMIT


def is_token_list(value: Any) -> bool:
    """A non-empty list of token ids (each `is_token_id`)."""
    return isinstance(value, list) and bool(value) and all(is_token_id(t) for t in value)


def chat_messages(body: dict[str, Any], documents: bool = False) -> generation_pb2.ChatMessages:
    """`messages`: roles, contents (a string, or text parts joined by newlines) and names (for
    the chat template), and how the template renders them (`chat_options`; with `documents`,
    vLLM's chat completions field of that name too: its /tokenize has none)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_param("messages", "expected a non-empty array of messages")
    out = generation_pb2.ChatMessages()
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise bad_param(where, "expected an object with role and content")
        role = message.get("role")
        if not isinstance(role, str) or not role:
            raise bad_param(f"{where}.role", "expected a non-empty string")
        if message.get("tool_calls"):  # a call this server would not render: never dropped
            raise bad_param(f"{where}.tool_calls", "tool calling is not supported")
        for key in (*_TEMPLATE_FIELDS.get(role, ()), "task"):  # not rendered here
            if message.get(key):
                raise bad_param(f"{where}.{key}", "is not supported")
        name = message.get("name")
        if name is not None and not isinstance(name, str):
            raise bad_param(f"{where}.name", "expected a string")
        content = content_text(message.get("content"), where)
        out.messages.add(role=role, content=content, name=name or "")
    if field(body, "tools", "array") or field(body, "functions", "array"):
        raise bad_param("tools", "tool calling is not supported")
    chat_options(body, out, documents)
    return out


def chat_options(
    body: dict[str, Any], out: generation_pb2.ChatMessages, documents: bool = False
) -> None:
    """vLLM's chat template fields into `out`: `add_generation_prompt` (default true; set on
    the wire only when given), `continue_final_message` (400 with add_generation_prompt true,
    given or by default, as vLLM answers), `add_special_tokens`, `chat_template_kwargs` (an
    object, as compact JSON text of at most MAX_TEMPLATE_KWARGS_BYTES; its `chat_template` is
    refused as `chat_template` is, its `tools` as tools are) and, with `documents`, vLLM's
    `documents` (a list of objects of strings). The workers resolve the variables."""
    agp = field(body, "add_generation_prompt", "boolean")
    cfm = field(body, "continue_final_message", "boolean", False)
    if cfm and agp is not False:  # vLLM's default add_generation_prompt is true
        raise bad_param("continue_final_message",
                        "cannot be true together with add_generation_prompt")  # fmt: skip
    if agp is not None:
        out.add_generation_prompt = agp
    out.continue_final_message = cfm
    out.add_special_tokens = field(body, "add_special_tokens", "boolean", False)
    kwargs = field(body, "chat_template_kwargs", "object")
    if kwargs:
        if kwargs.get("chat_template") is not None:
            raise bad_param("chat_template_kwargs", f"chat_template: {_UNTRUSTED_TEMPLATE}")
        if kwargs.get("tools"):
            raise bad_param("chat_template_kwargs", "tools: tool calling is not supported")
        try:
            text = json.dumps(kwargs, ensure_ascii=False, separators=(",", ":"))
        except (ValueError, RecursionError):  # nested too deeply to encode
            raise bad_param("chat_template_kwargs", "is nested too deeply") from None
        size = len(text.encode())
        if size > MAX_TEMPLATE_KWARGS_BYTES:
            raise bad_param("chat_template_kwargs", f"is {size} bytes as JSON; at most "
                            f"{MAX_TEMPLATE_KWARGS_BYTES} are accepted")  # fmt: skip
        out.template_kwargs = text
    docs = field(body, "documents", "array") if documents else None
    if docs is not None:
        for i, document in enumerate(docs):
            ok = isinstance(document, dict) and all(isinstance(v, str) for v in document.values())
            if not ok:
                raise bad_param(f"documents[{i}]", "expected an object of strings")
        out.documents = json.dumps(docs, ensure_ascii=False, separators=(",", ":"))


def content_text(content: Any, where: str) -> str:
    """A message's content as text: null is empty, an array of text parts is joined by newlines
    as vLLM renders it for a chat template that takes strings (ApiError for other parts)."""
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise bad_param(f"{where}.content", "expected a string or an array of text parts")
    texts = []
    for j, part in enumerate(content):
        text = part.get("text") if isinstance(part, dict) else None
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(text, str):
            raise bad_param(f"{where}.content[{j}]", "only text parts are supported")
        texts.append(text)
    return "\n".join(texts)


def completion_logprobs(body: dict[str, Any]) -> int | None:
    """Completions: `logprobs` is the number of alternatives (0..20), null for none."""
    value = field(body, "logprobs", "integer")
    if value is not None and not 0 <= value <= MAX_TOP_LOGPROBS:
        raise bad_param("logprobs", f"must be in [0, {MAX_TOP_LOGPROBS}], got {value}")
    return value  # type: ignore[no-any-return]


def chat_logprobs(body: dict[str, Any]) -> int | None:
    """Chat: `logprobs` (bool) turns them on, `top_logprobs` (0..20) adds alternatives (more
    than 0 only with logprobs)."""
    enabled = field(body, "logprobs", "boolean", False)
    top = field(body, "top_logprobs", "integer")
    if top is not None:
        if not 0 <= top <= MAX_TOP_LOGPROBS:
            raise bad_param("top_logprobs", f"must be in [0, {MAX_TOP_LOGPROBS}], got {top}")
        if top and not enabled:  # 0 asks for nothing (vLLM accepts it alone)
            raise bad_param("top_logprobs", "needs logprobs: true")
    return (top or 0) if enabled else None


# /tokenize fields that are not implemented: field -> whether a value changes nothing (null
# always does). Any other value is a 400 naming it (the chat template options are served as
# the chat endpoint serves them).
_TOKENIZE_AS_GENERATED: dict[Kind, dict[str, Callable[[Any], bool]]] = {
    "completion": {},
    "chat": {
        "chat_template": lambda v: False,
        "mm_processor_kwargs": lambda v: v == {},
    },
}


@dataclass(frozen=True)
class TokenizeRequest:
    """vLLM's /tokenize body: a completion's `prompt` or a chat's `messages`, as the request
    whose prompt the workers prepare (its token ids are the answer)."""

    model: str | None
    request: generation_pb2.GenerateRequest
    return_token_strs: bool


def parse_tokenize(body: Any) -> TokenizeRequest:
    """vLLM's completion form ({model, prompt, add_special_tokens}) or chat form ({model,
    messages, add_generation_prompt, continue_final_message, add_special_tokens,
    chat_template_kwargs, ...}: with `messages`; `documents` is not a field of it, as in
    vLLM); ApiError 400 naming the bad field, also for a request chat template."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    kind: Kind = "chat" if "messages" in body else "completion"
    model = field(body, "model", "string")
    strs = field(body, "return_token_strs", "boolean", False)
    for name, as_generated in _TOKENIZE_AS_GENERATED[kind].items():
        value = body.get(name)
        if value is not None and not as_generated(value):
            raise bad_param(name, _REFUSED_WHY.get(name, "is not supported"))
    request = generation_pb2.GenerateRequest(
        sampling=generation_pb2.SamplingParams(max_tokens=1)  # the prompt alone is checked
    )
    if kind == "chat":
        request.chat.CopyFrom(chat_messages(body))
    else:
        prompt = body.get("prompt")
        if not isinstance(prompt, str) or not prompt:
            raise bad_param("prompt", "expected a non-empty string (or give messages)")
        request.text = prompt
        special = field(body, "add_special_tokens", "boolean")
        if special is not None:
            request.add_special_tokens = special
    return TokenizeRequest(model, request, strs)


def parse_detokenize(body: Any) -> tuple[str | None, list[int]]:
    """vLLM's /detokenize body {model, tokens}: the model and the token ids (ints in
    [0, 2**31)); ApiError 400 naming `tokens` or the bad `tokens[i]`."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    model = field(body, "model", "string")
    tokens = body.get("tokens")
    if not isinstance(tokens, list):
        raise bad_param("tokens", "expected an array of token ids")
    for i, token in enumerate(tokens):
        if not is_token_id(token):
            raise bad_param(f"tokens[{i}]", f"expected a token id in [0, {TOKEN_ID_LIMIT})")
    return model, tokens
