"""`LLM.chat`'s chat template keywords, vLLM 0.32's `LLM.chat` ones (`add_generation_prompt`,
`continue_final_message`, `chat_template_kwargs`, `tokenization_kwargs`'s `add_special_tokens`,
`chat_template`) on the tiny checkpoint's real tokenizer with a template that reads
`enable_thinking`, `documents`, `mode` and `bos_token`: the prompt ids equal transformers'
apply_chat_template with the same arguments and the ids the served paths' Prepare renders for
the same options (`chat_prompt_ids`, what /tokenize answers), each output's `prompt` is the
rendered text, and bad keywords are InvalidParameterError naming them, with nothing queued."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kvmesh import LLM, SamplingParams
from kvmesh.engine.chat import ChatOptions, chat_prompt_ids
from kvmesh.engine.errors import InvalidParameterError
from kvmesh.models.tiny import build_tiny_model
from kvmesh.models.tokenizer import set_chat_template

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
TEMPLATE = (
    "{% if mode is defined and mode not in ['a', 'b'] %}"
    "{{ raise_exception('mode must be a or b') }}{% endif %}"
    "{{ bos_token }}{% for d in documents or [] %}<|doc|>{{ d['title'] }}\n{% endfor %}"
    "{% for m in messages if m['role'] != 'hidden' %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think></think>\n{% endif %}"
    "{% endif %}"
)
# A caller's own template: no BOS, the messages as `[role] content`, a `greeting` variable.
CUSTOM = (
    "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    "{% if greeting is defined %}({{ greeting }})\n{% endif %}"
    "{% if add_generation_prompt %}[assistant] {% endif %}"
)
ONE = [{"role": "user", "content": "Hello, 世界"}]
PARTIAL = [*ONE, {"role": "assistant", "content": "Sure "}]
DOCUMENTS = [{"title": "T1", "text": "one"}]


@pytest.fixture(scope="module")
def llm(tmp_path_factory: pytest.TempPathFactory) -> LLM:
    checkpoint = build_tiny_model(tmp_path_factory.mktemp("chat-kw"), "llama", "test", seed=0)
    set_chat_template(checkpoint, TEMPLATE)
    return LLM(model=str(checkpoint), num_kv_blocks=64, max_model_len=256, num_threads=1)


def reference(llm: LLM, messages: Any, special: bool = False, **arguments: Any) -> str:
    """transformers' rendering with these apply_chat_template arguments (the generation prompt
    unless told otherwise)."""
    arguments.setdefault("add_generation_prompt", True)
    text = llm.get_tokenizer().apply_chat_template(messages, tokenize=False, **arguments)
    return str(text)


# (name, LLM.chat keywords, messages, apply_chat_template arguments, add_special_tokens)
CASES: list[tuple[str, dict[str, Any], Any, dict[str, Any], bool]] = [
    ("default", {}, ONE, {}, False),
    ("no generation prompt", {"add_generation_prompt": False}, ONE,
     {"add_generation_prompt": False}, False),
    ("continue final message", {"add_generation_prompt": False, "continue_final_message": True},
     PARTIAL, {"add_generation_prompt": False, "continue_final_message": True}, False),
    ("add special tokens", {"tokenization_kwargs": {"add_special_tokens": True}}, ONE, {}, True),
    ("no special tokens", {"tokenization_kwargs": {"add_special_tokens": False}}, ONE, {}, False),
    ("thinking off", {"chat_template_kwargs": {"enable_thinking": False}}, ONE,
     {"enable_thinking": False}, False),
    ("documents", {"chat_template_kwargs": {"documents": DOCUMENTS}}, ONE,
     {"documents": DOCUMENTS}, False),
    ("variables", {"chat_template_kwargs": {"mode": "a", "bos_token": "B", "unread": [1]}}, ONE,
     {"mode": "a", "bos_token": "B"}, False),
    ("keywords win", {"chat_template_kwargs": {"add_generation_prompt": False,
                                               "continue_final_message": True, "tokenize": True,
                                               "max_length": 2}}, ONE, {}, False),
    ("own template", {"chat_template": CUSTOM}, ONE, {"chat_template": CUSTOM}, False),
    ("own template and variables", {"chat_template": CUSTOM,
                                    "chat_template_kwargs": {"greeting": "hi", "mode": "z"}},
     ONE, {"chat_template": CUSTOM, "greeting": "hi"}, False),
    ("own template continued", {"chat_template": CUSTOM, "add_generation_prompt": False,
                                "continue_final_message": True}, PARTIAL,
     {"chat_template": CUSTOM, "add_generation_prompt": False, "continue_final_message": True},
     False),
    ("template among the variables", {"chat_template_kwargs": {"chat_template": CUSTOM}}, ONE,
     {"chat_template": CUSTOM}, False),
    ("the keyword's template wins", {"chat_template": CUSTOM,
                                     "chat_template_kwargs": {"chat_template": "{{ 'x' }}"}},
     ONE, {"chat_template": CUSTOM}, False),
]  # fmt: skip


@pytest.mark.parametrize(("keywords", "messages", "arguments", "special"),
                         [c[1:] for c in CASES], ids=[c[0] for c in CASES])  # fmt: skip
def test_prompt_is_apply_chat_template_with_the_same_arguments(
    llm: LLM, keywords: dict[str, Any], messages: Any, arguments: dict[str, Any], special: bool
) -> None:
    """The output's prompt and prompt ids are transformers' with the same arguments, its greedy
    tokens those of generate on the ids; without `chat_template` the ids are also the served
    paths' (`chat_prompt_ids` of the same ChatOptions, e.g. /tokenize's chat form)."""
    tokenizer = llm.get_tokenizer()
    text = reference(llm, messages, **arguments)
    expected = list(tokenizer.encode(text, add_special_tokens=special))
    (out,) = llm.chat(messages, GREEDY, **keywords)
    assert (out.prompt, out.prompt_token_ids) == (text, expected)
    assert out.outputs[0].token_ids == llm.generate([expected], GREEDY)[0].outputs[0].token_ids
    if "chat_template" not in keywords and "chat_template" not in arguments:
        options = ChatOptions(
            add_generation_prompt=keywords.get("add_generation_prompt", True),
            continue_final_message=keywords.get("continue_final_message", False),
            add_special_tokens=special,
            template_kwargs=keywords.get("chat_template_kwargs", {}),
        )
        assert chat_prompt_ids(tokenizer, messages, 256, "messages", options) == expected
    assert not llm.engine.has_unfinished()


def test_options_apply_to_each_conversation_of_a_batch(llm: LLM) -> None:
    keywords: dict[str, Any] = {"chat_template": CUSTOM, "add_generation_prompt": False,
                                "chat_template_kwargs": {"greeting": "hey"}}  # fmt: skip
    outputs = llm.chat([ONE, PARTIAL], GREEDY, **keywords)
    for out, conv in zip(outputs, (ONE, PARTIAL), strict=True):
        text = reference(llm, conv, chat_template=CUSTOM, add_generation_prompt=False,
                         greeting="hey")  # fmt: skip
        assert out.prompt == text and text.endswith("(hey)\n")
        assert out.prompt_token_ids == llm.get_tokenizer().encode(text, add_special_tokens=False)


def test_special_tokens_and_thinking_change_the_ids_as_they_should(llm: LLM) -> None:
    tokenizer = llm.get_tokenizer()
    default = llm.chat(ONE, GREEDY)[0].prompt_token_ids
    special = llm.chat(ONE, GREEDY, tokenization_kwargs={"add_special_tokens": True})
    assert special[0].prompt_token_ids == [tokenizer.bos_token_id, *default]  # BOS twice
    thinking = llm.chat(ONE, GREEDY, chat_template_kwargs={"enable_thinking": False})
    tail = tokenizer.encode("<think></think>\n", add_special_tokens=False)
    assert thinking[0].prompt_token_ids == default + tail


def test_a_template_serves_a_model_without_one(tmp_path: Path) -> None:
    """As vLLM's `LLM.chat(chat_template=...)`: the caller's template renders for a tokenizer
    that has none (the model's own is still required without it)."""
    from transformers import AutoTokenizer

    from kvmesh.models.tokenizer import save_byte_tokenizer

    save_byte_tokenizer(tmp_path, model_max_length=256)
    plain = AutoTokenizer.from_pretrained(tmp_path)
    options = ChatOptions(template=CUSTOM)
    text = plain.apply_chat_template(ONE, chat_template=CUSTOM, tokenize=False,
                                     add_generation_prompt=True)  # fmt: skip
    assert chat_prompt_ids(plain, ONE, 256, options=options) == plain.encode(
        text, add_special_tokens=False
    )
    with pytest.raises(InvalidParameterError, match="no chat template"):
        chat_prompt_ids(plain, ONE, 256)


TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]


@pytest.mark.parametrize(
    ("messages", "keywords", "field", "says"),
    [
        (ONE, {"continue_final_message": True}, "continue_final_message",
         "add_generation_prompt"),
        ([*ONE, {"role": "hidden", "content": "x"}],
         {"continue_final_message": True, "add_generation_prompt": False},
         "continue_final_message", "final message"),
        (ONE, {"add_generation_prompt": "yes"}, "add_generation_prompt", "True or False"),
        (ONE, {"continue_final_message": 1}, "continue_final_message", "True or False"),
        (ONE, {"tools": TOOLS}, "tools", "not supported"),
        (ONE, {"chat_template_kwargs": {"tools": TOOLS}}, "chat_template_kwargs.tools",
         "not supported"),
        (ONE, {"chat_template_kwargs": [1]}, "chat_template_kwargs", "dict"),
        (ONE, {"chat_template_kwargs": {1: 2}}, "chat_template_kwargs", "string keys"),
        (ONE, {"chat_template_kwargs": {"mode": "c"}}, "chat_template_kwargs",
         "mode must be a or b"),
        (ONE, {"chat_template_kwargs": {"documents": [1]}}, "chat_template_kwargs.documents[0]",
         "strings"),
        (ONE, {"chat_template": 3}, "chat_template", "Jinja"),
        (ONE, {"chat_template_kwargs": {"chat_template": 3}},
         "chat_template_kwargs.chat_template", "Jinja"),
        (ONE, {"chat_template": "{% for %}"}, "chat_template", "refused"),
        (ONE, {"chat_template": "{{ raise_exception('nope') }}"}, "messages", "nope"),
        (ONE, {"tokenization_kwargs": {"truncation": True}}, "tokenization_kwargs.truncation",
         "add_special_tokens"),
        (ONE, {"tokenization_kwargs": {"add_special_tokens": "yes"}},
         "tokenization_kwargs.add_special_tokens", "True or False"),
        (ONE, {"tokenization_kwargs": "x"}, "tokenization_kwargs", "dict"),
        ([ONE, [{"role": "user", "content": "no"}]],
         {"chat_template": "{% if messages[0]['content'] == 'no' %}{{ raise_exception('no!') }}"
                           "{% endif %}x"}, "messages[1]", "no!"),
    ],
)  # fmt: skip
def test_bad_keywords_name_the_keyword_and_queue_nothing(
    llm: LLM, messages: Any, keywords: dict[str, Any], field: str, says: str
) -> None:
    with pytest.raises(InvalidParameterError) as caught:
        llm.chat(messages, GREEDY, **keywords)
    assert caught.value.field == field and says in caught.value.message, caught.value
    assert not llm.engine.has_unfinished()
