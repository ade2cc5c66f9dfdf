"""`kvmesh up` on the embedded default model (SmolLM2-135M-Instruct), disaggregated, driven by
the official `openai` client as a user would: a streamed chat answer that is right, n > 1 through
prefill and decode, and every block back to zero afterwards."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest
from sys_harness import idle, local_system, wait_until

from kvmesh.cli.up import LocalSystem

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def system() -> Iterator[LocalSystem]:
    with local_system(model=None, http_port=0) as (started, _):
        yield started


def rendered_question(system: LocalSystem) -> list[int]:
    """The question's prompt ids as transformers renders it with the model's chat template."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(system.model_dir)
    rendered = tokenizer.apply_chat_template(
        QUESTION, add_generation_prompt=True, tokenize=True, return_dict=True
    )
    return list(rendered["input_ids"])


def api(system: LocalSystem) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{system.http_url}/v1", api_key="unused", max_retries=0)


def test_streamed_chat_answer_is_right(system: LocalSystem) -> None:
    client = api(system)
    model = client.models.list().data[0].id
    assert "SmolLM2" in model
    stream = client.chat.completions.create(
        model=model, messages=QUESTION, max_tokens=24, temperature=0, stream=True,  # type: ignore[arg-type]
        stream_options={"include_usage": True},
    )  # fmt: skip
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert "Paris" in text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "stop"
    usage = chunks[-1].usage
    assert usage is not None and 1 <= usage.completion_tokens <= 24
    assert usage.prompt_tokens == len(rendered_question(system))
    wait_until(lambda: idle(system), 10.0, "blocks free after the chat")


def test_n_sampled_chat_answers_through_prefill_and_decode(system: LocalSystem) -> None:
    client = api(system)
    model = client.models.list().data[0].id
    first = client.chat.completions.create(
        model=model, messages=QUESTION, n=3, max_tokens=12, temperature=0.9, seed=7,  # type: ignore[arg-type]
    )  # fmt: skip
    again = client.chat.completions.create(
        model=model, messages=QUESTION, n=3, max_tokens=12, temperature=0.9, seed=7,  # type: ignore[arg-type]
    )  # fmt: skip
    assert sorted(c.index for c in first.choices) == [0, 1, 2]
    texts = [c.message.content for c in sorted(first.choices, key=lambda c: c.index)]
    assert texts == [c.message.content for c in sorted(again.choices, key=lambda c: c.index)]
    assert all(texts)
    assert len(set(texts)) > 1  # each completion samples on its own (seed + index)
    assert first.usage is not None and 3 <= first.usage.completion_tokens <= 36
    assert first.usage.prompt_tokens == len(rendered_question(system))
    wait_until(lambda: idle(system), 10.0, "blocks free after n = 3")
