"""`LLM.chat`: conversations rendered with the model's chat template (ids equal transformers'
`apply_chat_template`), batches of conversations, and errors naming the field."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kvmesh import LLM, SamplingParams
from kvmesh.engine.chat import chat_prompt_ids
from kvmesh.engine.errors import InvalidParameterError
from kvmesh.models.tiny import build_tiny_model
from kvmesh.models.tokenizer import set_chat_template

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
ONE = [{"role": "user", "content": "Hello, 世界"}]
TWO = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "é?"}]


@pytest.fixture(scope="module")
def llm(tmp_path_factory: pytest.TempPathFactory) -> LLM:
    checkpoint = build_tiny_model(tmp_path_factory.mktemp("chat"), "llama", "test", seed=0)
    set_chat_template(checkpoint)
    return LLM(model=str(checkpoint), num_kv_blocks=64, max_model_len=256, num_threads=1)


def template_ids(llm: LLM, messages: list[dict[str, str]]) -> list[int]:
    ids: Any = llm.get_tokenizer().apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True
    )
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def test_chat_equals_generate_on_the_templates_ids(llm: LLM) -> None:
    expected = [template_ids(llm, conv) for conv in (ONE, TWO)]
    plain = llm.generate(expected, GREEDY)
    single = llm.chat(ONE, GREEDY)
    batch = llm.chat([ONE, TWO], GREEDY)
    assert len(single) == 1 and len(batch) == 2
    assert single[0].prompt_token_ids == expected[0]
    for got, want in zip(batch, plain, strict=True):
        assert got.prompt_token_ids == want.prompt_token_ids
        assert got.outputs[0].token_ids == want.outputs[0].token_ids
        assert len(got.outputs[0].token_ids) == 6
    assert single[0].outputs[0].token_ids == plain[0].outputs[0].token_ids


def test_a_chat_outputs_prompt_is_the_rendered_template(llm: LLM) -> None:
    """As vLLM's `LLM.chat`, each RequestOutput's `prompt` is its conversation rendered by the
    chat template with the generation prompt (the text its prompt_token_ids encode), not None."""
    tokenizer = llm.get_tokenizer()
    outputs = llm.chat([ONE, TWO], GREEDY)
    for out, conv in zip(outputs, (ONE, TWO), strict=True):
        text = tokenizer.apply_chat_template(conv, add_generation_prompt=True, tokenize=False)
        assert out.prompt == text
        assert out.prompt_token_ids == tokenizer.encode(text, add_special_tokens=False)


def test_a_messages_name_reaches_the_template(llm: LLM) -> None:
    """OpenAI's `name` of a message is the template's `name` (this template writes
    `<|user:ann|>`); a message without one has no `name` key."""
    named = [{"role": "user", "content": "hi", "name": "ann"}]
    got = llm.chat(named, GREEDY)[0].prompt_token_ids
    assert got == template_ids(llm, named)
    assert got != template_ids(llm, [{"role": "user", "content": "hi"}])
    assert bytes(got[1:]).startswith(b"<|user:ann|>")


@pytest.mark.parametrize(
    ("messages", "field"),
    [
        ([], "messages"),
        ([{"role": "user", "content": "x", "name": 7}], "messages[0].name"),
        ([{"role": "user", "content": "x", "name": "n" * 65}], "messages[0].name"),
        ([{"role": "", "content": "x"}], "messages[0].role"),
        ([{"role": "user"}], "messages[0].content"),
        ([{"role": "user", "content": "x" * 9000}], "messages"),
        ([ONE, [{"role": "user", "content": 3}]], "messages[1][0].content"),
    ],
)
def test_bad_conversations_name_the_field_and_queue_nothing(
    llm: LLM, messages: Any, field: str
) -> None:
    with pytest.raises(InvalidParameterError) as info:
        llm.chat(messages, GREEDY)
    assert info.value.field == field
    assert not llm.engine.has_unfinished()


def test_tokenizer_without_template_is_refused(llm: LLM, tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    from kvmesh.models.tokenizer import save_byte_tokenizer

    save_byte_tokenizer(tmp_path, model_max_length=256)
    plain = AutoTokenizer.from_pretrained(tmp_path)
    with pytest.raises(InvalidParameterError, match="no chat template") as info:
        chat_prompt_ids(plain, ONE, 256)
    assert info.value.field == "messages"
    with pytest.raises(InvalidParameterError, match="no chat template"):
        chat_prompt_ids(None, ONE, 256)
