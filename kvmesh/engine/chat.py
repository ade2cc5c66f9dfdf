"""Chat prompts: a conversation rendered with the tokenizer's own chat template, then tokenized.

`chat_prompt_ids(tokenizer, messages, max_model_len)` equals transformers'
`apply_chat_template(messages, add_generation_prompt=True, tokenize=True)` ids: the rendered
text already holds the template's special tokens (BOS included), so it is tokenized without
adding them again. Every input is bounded before any rendering or tokenizing work
(`check_text_size`), so a worker can run the work off its event loop knowing it is short.
Errors are `InvalidParameterError` naming the field (`field` is the caller's name for it).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from kvmesh.engine.errors import InvalidParameterError

# Text longer than max_model_len * this can never fit (a token is far shorter on average), so
# it is refused before tokenizing. Generous: a run of whitespace can be a single token.
MAX_CHARS_PER_TOKEN = 32
MAX_ROLE_CHARS = 64

Message = Mapping[str, Any]


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
    tokenizer: Any, messages: Sequence[Message], max_model_len: int, field: str = "messages"
) -> list[int]:
    """Token ids of the conversation (named `field`) rendered with the model's chat template
    plus the generation prompt (InvalidParameterError naming the field for a model without a
    template, bad messages or a template that refuses them)."""
    return rendered_ids(tokenizer, chat_prompt_text(tokenizer, messages, max_model_len, field))


def rendered_ids(tokenizer: Any, text: str) -> list[int]:
    """Token ids of a rendered conversation: the template wrote its special tokens already."""
    return list(tokenizer.encode(text, add_special_tokens=False))


def chat_prompt_text(
    tokenizer: Any, messages: Sequence[Message], max_model_len: int, field: str = "messages"
) -> str:
    """The text `chat_prompt_ids` encodes: the conversation rendered with the chat template
    and the generation prompt (vLLM's `RequestOutput.prompt` of `LLM.chat`)."""
    if not has_chat_template(tokenizer):
        raise InvalidParameterError(field, "this model has no chat template")
    conversation = check_messages(messages, max_model_len, field)
    try:
        text = tokenizer.apply_chat_template(
            conversation, tokenize=False, add_generation_prompt=True
        )
    except Exception as exc:  # jinja2 errors, raise_exception() in the template
        raise InvalidParameterError(field, f"the chat template refused it: {exc}") from None
    check_text_size(len(text), max_model_len, field)
    return str(text)
