"""A real `kvmesh up` on a model whose generation_config.json sets sampling defaults: the
OpenAI door's requests that leave them unset sample with the model's (vLLM's
`--generation-config auto`), on the prefill and decode workers alike."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from sys_harness import idle, local_system, openai_client, wait_until

from kvmesh.cli.up import LocalSystem
from tests.checkpoints import with_generation_config

PROMPT = [5, 9, 2, 44, 17]
MAX_NEW_TOKENS = 5


@pytest.fixture(scope="module")
def system(tiny_model: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalSystem]:
    fields = {"temperature": 0.8, "top_k": 1, "max_new_tokens": MAX_NEW_TOKENS}
    folder = with_generation_config(tiny_model, tmp_path_factory.mktemp("gen") / "model", **fields)
    with local_system(model=str(folder), http_port=0) as (started, _):
        yield started


def test_unset_sampling_takes_the_models_generation_config(system: LocalSystem) -> None:
    client = openai_client(system)
    model = client.models.list().data[0].id
    # top_k 1 from the model: every seed gives the most likely tokens
    texts = {
        client.completions.create(model=model, prompt=PROMPT, seed=seed).choices[0].text
        for seed in range(4)
    }
    assert len(texts) == 1
    greedy = client.completions.create(model=model, prompt=PROMPT, temperature=0.0)
    assert texts == {greedy.choices[0].text}
    # a chat without a length stops at the model's max_new_tokens (completions keep 16)
    chat = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "hello"}],
        extra_body={"ignore_eos": True},
    )
    assert chat.usage is not None and chat.usage.completion_tokens == MAX_NEW_TOKENS
    assert chat.choices[0].finish_reason == "length"
    # a request's own fields win: top_k 0 turns the model's top_k off
    sampled = {
        client.completions.create(
            model=model, prompt=PROMPT, seed=seed, max_tokens=8, extra_body={"top_k": 0}
        )
        .choices[0]
        .text
        for seed in range(4)
    }
    assert len(sampled) > 1
    wait_until(lambda: idle(system), 5.0, "blocks free after the requests")
