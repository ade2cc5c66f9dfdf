"""A real `kvmesh up` on a model whose generation_config.json sets `max_new_tokens`: a chat
without a length whose prompt leaves less room in the context than that is served up to the
context, as vLLM's `get_max_tokens` takes the least of the room left and the model's default,
instead of refused naming a `max_tokens` the client never sent; an explicit length too."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest
from sys_harness import idle, local_system, openai_client, wait_until

from kvmesh.cli.up import LocalSystem
from tests.checkpoints import with_generation_config

MAX_NEW_TOKENS = 8
ROOM = 3  # context left after the prompt: fewer than MAX_NEW_TOKENS


@pytest.fixture(scope="module")
def system(tiny_model: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalSystem]:
    folder = tmp_path_factory.mktemp("gen-ctx") / "model"
    with_generation_config(tiny_model, folder, max_new_tokens=MAX_NEW_TOKENS)
    with local_system(model=str(folder), http_port=0) as (started, _):
        yield started


def filling_message(model: str, room: int) -> list[dict[str, str]]:
    """A one-message conversation whose rendered prompt leaves `room` tokens of the context."""
    from transformers import AutoConfig, AutoTokenizer

    from kvmesh.engine.chat import chat_prompt_ids

    tokenizer = AutoTokenizer.from_pretrained(model)
    context = AutoConfig.from_pretrained(model).max_position_embeddings
    overhead = len(chat_prompt_ids(tokenizer, [{"role": "user", "content": ""}], context, "m"))
    messages = [{"role": "user", "content": "a" * (context - room - overhead)}]
    assert len(chat_prompt_ids(tokenizer, messages, context, "m")) == context - room  # bytes
    return messages


def test_an_open_ended_chat_near_the_context_is_served_up_to_it(system: LocalSystem) -> None:
    client = openai_client(system)
    model = client.models.list().data[0].id
    chat = client.chat.completions.create(
        model=model,
        messages=filling_message(system.config.model, ROOM),  # type: ignore[arg-type]
        temperature=0.0,
        extra_body={"ignore_eos": True},
    )
    assert chat.usage is not None and chat.usage.completion_tokens == ROOM
    assert chat.choices[0].finish_reason == "length"
    # an explicit length the prompt leaves no room for is served up to the context too, as
    # vLLM clamps it; only a length beyond the whole context is refused
    clamped = client.chat.completions.create(
        model=model,
        messages=filling_message(system.config.model, ROOM),  # type: ignore[arg-type]
        max_tokens=MAX_NEW_TOKENS,
        temperature=0.0,
        extra_body={"ignore_eos": True},
    )
    assert clamped.usage is not None and clamped.usage.completion_tokens == ROOM
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=4096
        )
    wait_until(lambda: idle(system), 5.0, "blocks free after the requests")
