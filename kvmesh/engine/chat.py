"""Chat prompts: a conversation rendered with the tokenizer's own chat template, then tokenized.

`chat_prompt_ids(tokenizer, messages, max_model_len)` equals transformers'
`apply_chat_template(messages, add_generation_prompt=True, tokenize=True)` ids: the rendered
text already holds the template's special tokens (BOS included), so it is tokenized without
adding them again. `ChatOptions` carries vLLM's chat request fields (`add_generation_prompt`,
`continue_final_message`, `add_special_tokens`, `chat_template_kwargs`, `documents`), resolved
as vLLM 0.32 resolves them (`template_arguments`), and the offline API's `chat_template` (a
template of the caller's rendering instead of the model's). Every input is bounded before any
rendering or tokenizing work (`check_text_size`), so a worker can run the work off its event
loop knowing it is short.
Errors are `InvalidParameterError` naming the field (`field` is the caller's name for it).
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import lru_cache
from typing import Any

from kvmesh.engine.errors import InvalidParameterError

# Text longer than max_model_len * this can never fit (a token is far shorter on average), so
# it is refused before tokenizing. Generous: a run of whitespace can be a single token.
MAX_CHARS_PER_TOKEN = 32
MAX_ROLE_CHARS = 64

Message = Mapping[str, Any]

MAX_TEMPLATE_KWARGS_BYTES = 65536  # the JSON text of a request's template variables
MAX_JSON_DEPTH = 32  # nesting of template variables and documents
# Template variables that the request's own fields set (vLLM 0.32: the fields win).
_OVERRIDDEN_KWARGS = frozenset({"add_generation_prompt", "continue_final_message"})


@dataclass(frozen=True)
class ChatOptions:
    """How a conversation is rendered and tokenized (vLLM's chat request fields):
    `template_kwargs` are the extra template variables, `documents` the template's
    `documents` (None: none), `template` a chat template (Jinja text, or the name of one of
    the tokenizer's named templates) rendering instead of the model's: the offline API's
    `chat_template`, whose caller owns the process; the served paths never set it."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    template_kwargs: Mapping[str, Any] = field(default_factory=dict)
    documents: list[dict[str, str]] | None = None
    template: str | None = None


DEFAULT_OPTIONS = ChatOptions()


def _decode_json(text: str, field: str, what: str, limit: int) -> Any:
    """`text` as JSON (InvalidParameterError naming `field`): at most `limit` UTF-8 bytes and
    MAX_JSON_DEPTH levels of nesting."""
    size = len(text) if len(text) > limit or text.isascii() else len(text.encode("utf-8"))
    if size > limit:
        raise InvalidParameterError(field, f"is {size} bytes; at most {limit} are accepted")
    try:
        value = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise InvalidParameterError(field, f"must be the text of a JSON {what}: {exc}") from None
    if _nesting(value, MAX_JSON_DEPTH) > MAX_JSON_DEPTH:
        raise InvalidParameterError(field, f"nests deeper than {MAX_JSON_DEPTH} levels")
    return value


def _nesting(value: Any, limit: int) -> int:
    """Levels of lists and objects in `value`, counted up to `limit` + 1."""
    level, depth = [value], 0
    while depth <= limit:
        inner = [v for each in level if isinstance(each, dict) for v in each.values()]
        inner += [v for each in level if isinstance(each, list) for v in each]
        if not any(isinstance(each, (dict, list)) for each in level):
            return depth
        level, depth = inner, depth + 1
    return depth


def check_documents(documents: Any, field: str) -> list[dict[str, str]]:
    """vLLM's `documents`: a list of objects whose values are strings (InvalidParameterError
    naming `field` or the bad `field[i]`)."""
    if not isinstance(documents, list):
        raise InvalidParameterError(field, "must be a list of objects")
    for i, document in enumerate(documents):
        ok = isinstance(document, dict) and all(isinstance(v, str) for v in document.values())
        if not ok:
            raise InvalidParameterError(f"{field}[{i}]", "must be an object of strings")
    return documents


def parse_documents(text: str, max_model_len: int, field: str) -> list[dict[str, str]] | None:
    """The documents of their JSON text (empty: None), size-bounded as a prompt is."""
    if not text:
        return None
    value = _decode_json(text, field, "array", max_prompt_chars(max_model_len))
    return check_documents(value, field)


def parse_template_kwargs(text: str, field: str) -> dict[str, Any]:
    """A request's template variables of their JSON text (empty: none): an object of at most
    MAX_TEMPLATE_KWARGS_BYTES; `chat_template` is refused as vLLM refuses it without
    --trust-request-chat-template (InvalidParameterError naming `field` or `field.KEY`)."""
    if not text:
        return {}
    value = _decode_json(text, field, "object", MAX_TEMPLATE_KWARGS_BYTES)
    if not isinstance(value, dict):
        raise InvalidParameterError(field, "must be a JSON object")
    if value.get("chat_template") is not None:
        raise InvalidParameterError(
            f"{field}.chat_template",
            "a chat template given with the request is not trusted (vLLM serves one only "
            "when started with --trust-request-chat-template; kvmesh has no such flag): the "
            "model's own template renders every conversation",
        )
    if value.get("tools"):
        raise InvalidParameterError(f"{field}.tools", "tool calling is not supported")
    return value


@lru_cache(maxsize=16)
def _template_variables(template: str) -> frozenset[str]:
    """The variables a chat template reads but does not set (vLLM's filter of template
    variables); empty when it does not parse (its rendering will say why)."""
    import jinja2
    import jinja2.ext
    import jinja2.meta
    import jinja2.sandbox

    class Generation(jinja2.ext.Extension):  # transformers' {% generation %} blocks
        tags = {"generation"}  # noqa: RUF012 (jinja2 reads it per class)

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            call = self.call_method("_generation_support")
            return jinja2.nodes.CallBlock(call, [], [], body).set_lineno(lineno)

    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[Generation, jinja2.ext.loopcontrols]
    )
    try:
        return frozenset(jinja2.meta.find_undeclared_variables(env.parse(template)))
    except jinja2.TemplateError:
        return frozenset()


def _argument_names(tokenizer: Any) -> frozenset[str]:
    """The named arguments of the tokenizer's apply_chat_template."""
    try:
        parameters = inspect.signature(tokenizer.apply_chat_template).parameters.values()
    except (TypeError, ValueError):
        return frozenset()
    variadic = (inspect.Parameter.VAR_KEYWORD, inspect.Parameter.VAR_POSITIONAL)
    return frozenset(p.name for p in parameters if p.kind not in variadic)


def template_arguments(
    tokenizer: Any, options: ChatOptions, field: str
) -> tuple[dict[str, Any], list[dict[str, str]] | None]:
    """The keyword arguments and documents `apply_chat_template` gets for `options`' template
    variables, as vLLM 0.32 resolves them: a variable the template does not read is dropped,
    and so is every apply_chat_template argument (`tokenize`, `padding`, ...) but `documents`,
    which applies when `options.documents` is None; `add_generation_prompt` and
    `continue_final_message` are the options' own."""
    if not options.template_kwargs:  # every request without variables: nothing to resolve
        return {}, options.documents
    kwargs = dict(options.template_kwargs)
    documents = options.documents
    named = _argument_names(tokenizer) | _OVERRIDDEN_KWARGS | {"tokenize", "documents"}
    if documents is None and kwargs.get("documents") is not None:
        documents = check_documents(kwargs["documents"], f"{field}.documents")
    variables = _template_variables(_template_text(tokenizer, options.template))
    return {k: v for k, v in kwargs.items() if k in variables and k not in named}, documents


def _template_text(tokenizer: Any, template: str | None) -> str:
    """The Jinja text apply_chat_template renders with `template` (None: the model's own; a
    name: the tokenizer's template of that name); "" when there is none."""
    own = getattr(tokenizer, "chat_template", None)
    if template is None and isinstance(own, str):
        return own
    try:  # named templates: the one apply_chat_template picks
        return str(tokenizer.get_chat_template(template))
    except Exception:  # no template of that name or none at all: rendering says why
        return template or ""


def has_chat_template(tokenizer: Any) -> bool:
    """Whether `tokenizer` (None allowed) carries a chat template."""
    return bool(getattr(tokenizer, "chat_template", None))


def max_prompt_chars(max_model_len: int) -> int:
    """The longest prompt text (characters) considered for a model of this context length."""
    return max(1, max_model_len) * MAX_CHARS_PER_TOKEN


def check_text_size(chars: int, max_model_len: int, field: str) -> None:
    """InvalidParameterError naming `field` when `chars` exceeds `max_prompt_chars`."""
    limit = max_prompt_chars(max_model_len)
    if chars > limit:
        raise InvalidParameterError(
            field,
            f"{chars} characters can never fit the model's maximum length of {max_model_len} "
            f"tokens (at most {limit} characters are accepted)",
        )


def message_name(name: object, where: str) -> str:
    """A message's optional `name`: "" when absent; InvalidParameterError naming
    `where.name` unless a string of at most MAX_ROLE_CHARS."""
    if name is None:
        return ""
    if not isinstance(name, str):
        raise InvalidParameterError(f"{where}.name", "must be a string")
    if len(name) > MAX_ROLE_CHARS:
        raise InvalidParameterError(f"{where}.name", f"is longer than {MAX_ROLE_CHARS}")
    return name


def check_messages(messages: Sequence[Message], max_model_len: int, field: str) -> list[dict]:
    """The conversation (named `field`) as plain `{"role", "content"}` dicts (and `"name"` when
    a message has a non-empty one), checked: at least one message, each role a non-empty string
    and each name a string (at most MAX_ROLE_CHARS each), each content a string, and the total
    size bounded. Errors name `field`, `field[i].role`, `.name` or `.content`."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise InvalidParameterError(field, "must be a list of messages")
    if not messages:
        raise InvalidParameterError(field, "must contain at least one message")
    result, chars = [], 0
    for i, message in enumerate(messages):
        where = f"{field}[{i}]"
        if not isinstance(message, Mapping):
            raise InvalidParameterError(where, "must be a mapping with role and content")
        role, content = message.get("role"), message.get("content")
        if not isinstance(role, str) or not role:
            raise InvalidParameterError(f"{where}.role", "must be a non-empty string")
        if len(role) > MAX_ROLE_CHARS:
            raise InvalidParameterError(f"{where}.role", f"is longer than {MAX_ROLE_CHARS}")
        if not isinstance(content, str):
            raise InvalidParameterError(f"{where}.content", "must be a string")
        name = message_name(message.get("name"), where)
        chars += len(role) + len(content) + len(name)
        result.append({"role": role, "content": content, **({"name": name} if name else {})})
    check_text_size(chars, max_model_len, field)
    return result


def chat_prompt_ids(
    tokenizer: Any,
    messages: Sequence[Message],
    max_model_len: int,
    field: str = "messages",
    options: ChatOptions = DEFAULT_OPTIONS,
    where: str = "",
) -> list[int]:
    """Token ids of the conversation (named `field`) rendered with the model's chat template
    as `options` ask (by default with the generation prompt), plus the tokenizer's special
    tokens when `options.add_special_tokens` (InvalidParameterError naming the field for a
    model without a template, bad messages, or a template that refuses them; an option's
    error names it after `where`, e.g. `prompt.chat.template_kwargs`)."""
    text = chat_prompt_text(tokenizer, messages, max_model_len, field, options, where)
    return rendered_ids(tokenizer, text, options.add_special_tokens)


def rendered_ids(tokenizer: Any, text: str, add_special_tokens: bool = False) -> list[int]:
    """Token ids of a rendered conversation: the template wrote its special tokens already;
    `add_special_tokens` adds the tokenizer's on top (vLLM's chat `add_special_tokens`)."""
    return list(tokenizer.encode(text, add_special_tokens=add_special_tokens))


def chat_prompt_text(
    tokenizer: Any,
    messages: Sequence[Message],
    max_model_len: int,
    field: str = "messages",
    options: ChatOptions = DEFAULT_OPTIONS,
    where: str = "",
) -> str:
    """The text `chat_prompt_ids` encodes: the conversation rendered with the chat template
    as `options` ask (vLLM's `RequestOutput.prompt` of `LLM.chat`). A template that raises is
    InvalidParameterError naming what it refused: the template variables, documents or
    continue_final_message when it renders without them, `chat_template` for an
    `options.template` that does not parse, else the messages."""
    if tokenizer is None or (options.template is None and not has_chat_template(tokenizer)):
        raise InvalidParameterError(field, "this model has no chat template")
    conversation = check_messages(messages, max_model_len, field)
    if options.continue_final_message and options.add_generation_prompt:
        raise InvalidParameterError(
            f"{where}continue_final_message", "cannot be true together with add_generation_prompt"
        )
    kwargs, documents = template_arguments(tokenizer, options, f"{where}template_kwargs")
    try:
        text = _render(tokenizer, conversation, options, kwargs, documents)
    except Exception as exc:  # jinja2 errors, raise_exception() in the template
        blamed = _refused(tokenizer, conversation, options, kwargs, documents, where) or field
        if options.template is not None and _is_syntax_error(exc):
            blamed = f"{where}chat_template"
        raise InvalidParameterError(blamed, f"the chat template refused it: {exc}") from None
    check_text_size(len(text), max_model_len, field)
    return str(text)


def _render(
    tokenizer: Any,
    conversation: list[dict],
    options: ChatOptions,
    kwargs: Mapping[str, Any],
    documents: list[dict[str, str]] | None,
) -> str:
    extra: dict[str, Any] = dict(kwargs)
    if documents is not None:
        extra["documents"] = documents
    if options.continue_final_message:
        extra["continue_final_message"] = True
    if options.template is not None:
        extra["chat_template"] = options.template
    text = tokenizer.apply_chat_template(
        conversation,
        tokenize=False,
        add_generation_prompt=options.add_generation_prompt,
        **extra,
    )
    return str(text)


def _refused(
    tokenizer: Any,
    conversation: list[dict],
    options: ChatOptions,
    kwargs: Mapping[str, Any],
    documents: list[dict[str, str]] | None,
    where: str,
) -> str | None:
    """The option whose removal lets the template render (removed in this order: template
    variables, documents, continue_final_message); None when it refuses the messages alone."""
    documents_field = "documents" if options.documents is not None else "template_kwargs"
    steps: list[tuple[str, dict[str, Any], list[dict[str, str]] | None, ChatOptions]] = []
    if kwargs:
        steps.append(("template_kwargs", {}, documents, options))
    if documents is not None:
        steps.append((documents_field, {}, None, options))
    if options.continue_final_message:
        steps.append(
            ("continue_final_message", {}, None, replace(options, continue_final_message=False))
        )
    for name, fewer_kwargs, fewer_documents, fewer_options in steps:
        try:
            _render(tokenizer, conversation, fewer_options, fewer_kwargs, fewer_documents)
        except Exception:
            continue
        return f"{where}{name}"
    return None


def _is_syntax_error(exc: BaseException) -> bool:
    """Whether `exc` is a template that does not parse (not one raising while it renders)."""
    import jinja2

    return isinstance(exc, jinja2.TemplateSyntaxError)
