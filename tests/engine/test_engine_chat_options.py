"""vLLM's chat template options where the template is rendered (`kvmesh.engine.chat`, a worker's
Prepare): the ids equal transformers' apply_chat_template with the same arguments on the tiny
checkpoint's real tokenizer, template variables are resolved as vLLM 0.32 resolves them, and bad
values or a template that raises are InvalidParameterError naming what it refused."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kvmesh.engine.chat import (
    MAX_JSON_DEPTH,
    MAX_TEMPLATE_KWARGS_BYTES,
    ChatOptions,
    chat_prompt_ids,
    parse_documents,
    parse_template_kwargs,
)
from kvmesh.engine.errors import InvalidParameterError
from kvmesh.models.tiny import build_tiny_model
from kvmesh.models.tokenizer import set_chat_template

TEMPLATE = (
    "{% if mode is defined and mode not in ['a', 'b'] %}"
    "{{ raise_exception('mode must be a or b') }}{% endif %}"
    "{{ bos_token }}{% for d in documents or [] %}<|doc|>{{ d['title'] }}\n"
    "{% if d['title'] == 'bad' %}{{ raise_exception('bad document') }}{% endif %}{% endfor %}"
    "{% for m in messages if m['role'] != 'hidden' %}<|{{ m['role'] }}|>\n{{ m['content'] }}"
    "{% if m['content'] == 'no' %}{{ raise_exception('no!') }}{% endif %}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think></think>\n{% endif %}"
    "{% endif %}"
)
ONE = [{"role": "user", "content": "Hello, 世界"}]
PARTIAL = [*ONE, {"role": "assistant", "content": "Sure "}]
DOCUMENTS = [{"title": "T1", "text": "one"}]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from transformers import AutoTokenizer

    folder: Path = tmp_path_factory.mktemp("chat-options")
    build_tiny_model(folder, "llama", "test", seed=0)
    set_chat_template(folder, TEMPLATE)
    return AutoTokenizer.from_pretrained(str(folder))


def ids(tokenizer: Any, messages: Any = ONE, **options: Any) -> list[int]:
    return chat_prompt_ids(tokenizer, messages, 2048, "messages", ChatOptions(**options), "chat.")


def reference(tokenizer: Any, messages: Any = ONE, special: bool = False, **kw: Any) -> list[int]:
    kw.setdefault("add_generation_prompt", True)
    text = tokenizer.apply_chat_template(messages, tokenize=False, **kw)
    return list(tokenizer.encode(text, add_special_tokens=special))


@pytest.mark.parametrize(
    ("messages", "options", "arguments"),
    [
        (ONE, {}, {}),
        (ONE, {"add_generation_prompt": False}, {"add_generation_prompt": False}),
        (PARTIAL, {"add_generation_prompt": False, "continue_final_message": True},
         {"add_generation_prompt": False, "continue_final_message": True}),
        (ONE, {"add_special_tokens": True}, {"special": True}),
        (ONE, {"template_kwargs": {"enable_thinking": False}}, {"enable_thinking": False}),
        (ONE, {"template_kwargs": {"bos_token": "B"}}, {"bos_token": "B"}),
        (ONE, {"documents": DOCUMENTS}, {"documents": DOCUMENTS}),
        (ONE, {"template_kwargs": {"documents": DOCUMENTS}}, {"documents": DOCUMENTS}),
        (ONE, {"documents": [], "template_kwargs": {"documents": DOCUMENTS}}, {"documents": []}),
        (ONE, {"template_kwargs": {"mode": "a", "unread": 1}}, {"mode": "a"}),
    ],
)  # fmt: skip
def test_ids_equal_apply_chat_template_with_the_same_arguments(
    tokenizer: Any, messages: Any, options: dict[str, Any], arguments: dict[str, Any]
) -> None:
    assert ids(tokenizer, messages, **options) == reference(tokenizer, messages, **arguments)


def test_variables_naming_apply_chat_template_arguments_are_dropped(tokenizer: Any) -> None:
    """As vLLM 0.32: the request's fields win over the variables of the same name; the
    tokenizer call's own arguments, and variables the template does not read, change nothing."""
    dropped = {"add_generation_prompt": False, "continue_final_message": True, "tokenize": True,
               "return_tensors": "np", "max_length": 2, "padding": True, "conversation": [],
               "conversations": 1, "unread": {"x": [1]}}  # fmt: skip
    assert ids(tokenizer, template_kwargs=dropped) == reference(tokenizer)


@pytest.mark.parametrize(
    ("messages", "options", "field", "says"),
    [
        (ONE, {"template_kwargs": {"mode": "c"}}, "chat.template_kwargs", "mode must be a or b"),
        (ONE, {"template_kwargs": {"messages": []}}, "chat.template_kwargs", "messages"),
        ([{"role": "user", "content": "no"}], {"template_kwargs": {"mode": "a"}}, "messages",
         "no!"),
        (ONE, {"documents": [{"title": "bad"}]}, "chat.documents", "bad document"),
        (ONE, {"template_kwargs": {"documents": [{"title": "bad"}]}}, "chat.template_kwargs",
         "bad document"),
        (ONE, {"template_kwargs": {"documents": [1]}}, "chat.template_kwargs.documents[0]",
         "strings"),
        (ONE, {"continue_final_message": True}, "chat.continue_final_message",
         "add_generation_prompt"),
        ([*ONE, {"role": "hidden", "content": "x"}], {"continue_final_message": True,
                                                      "add_generation_prompt": False},
         "chat.continue_final_message", "final message"),
    ],
)  # fmt: skip
def test_refusals_name_what_the_template_refused(
    tokenizer: Any, messages: Any, options: dict[str, Any], field: str, says: str
) -> None:
    with pytest.raises(InvalidParameterError) as caught:
        ids(tokenizer, messages, **options)
    assert caught.value.field == field and says in caught.value.message, caught.value


def test_template_kwargs_and_documents_json_is_bounded(tokenizer: Any) -> None:
    field = "chat.template_kwargs"
    assert parse_template_kwargs("", field) == {}
    kwargs = {"enable_thinking": False, "n": 3, "x": [1.5, None, "é"]}
    assert parse_template_kwargs(json.dumps(kwargs), field) == kwargs
    deep = "[" * (MAX_JSON_DEPTH + 1) + "]" * (MAX_JSON_DEPTH + 1)
    bad = [("[1]", field, "object"), ("{", field, "JSON"), ('{"x": ' + deep + "}", field, "deeper"),
           (json.dumps({"x": "y" * MAX_TEMPLATE_KWARGS_BYTES}), field, "bytes"),
           ("[" * 100000, field, "bytes"),
           ('{"chat_template": "x"}', f"{field}.chat_template", "--trust-request-chat-template"),
           ('{"tools": [{}]}', f"{field}.tools", "tool calling")]  # fmt: skip
    for text, name, says in bad:
        with pytest.raises(InvalidParameterError) as caught:
            parse_template_kwargs(text, field)
        assert caught.value.field == name and says in caught.value.message, text[:40]
    assert parse_template_kwargs('{"chat_template": null}', field) == {"chat_template": None}
    assert parse_documents("", 64, "chat.documents") is None
    assert parse_documents(json.dumps(DOCUMENTS), 64, "chat.documents") == DOCUMENTS
    for text, name in (("{}", "chat.documents"), ('[{"a": 1}]', "chat.documents[0]"),
                       (json.dumps([{"t": "x" * 4096}]), "chat.documents")):  # fmt: skip
        with pytest.raises(InvalidParameterError) as caught:
            parse_documents(text, 64, "chat.documents")
        assert caught.value.field == name
