"""vLLM's extra endpoints on the HTTP door of a real `kvmesh up` (1 prefill + 1 decode worker on
the tiny test model with a chat template, loopback): /tokenize gives the ids the tokenizer and
chat template give, which are the ids a completion or chat request prefills; /detokenize
decodes them back; bad input is a 400 naming the field; /version and /ping. And a streamed
chat's chunks as vLLM and OpenAI send them: the role first, once per choice."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from sys_harness import idle, openai_client, wait_until

from kvmesh.cli.up import LocalSystem

MESSAGES: Any = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "héllo ✓"}]
GREEDY: dict[str, Any] = {"max_tokens": 6, "temperature": 0.0, "extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module")
def system(openai_system: LocalSystem) -> LocalSystem:
    return openai_system


@pytest.fixture(scope="module")
def tokenizer(tiny_model: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model)


def post(system: LocalSystem, path: str, body: object) -> httpx.Response:
    return httpx.post(f"{system.http_url}{path}", json=body, timeout=30)


def model_of(system: LocalSystem) -> str:
    return openai_client(system).models.list().data[0].id


def template_ids(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    """transformers' ids of the conversation with the generation prompt (vLLM's /tokenize)."""
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if not isinstance(ids, list) else ids)


def test_tokenize_text_gives_the_ids_a_completion_prefills(
    system: LocalSystem, tokenizer: Any
) -> None:
    model, text = model_of(system), "héllo wörld ✓"
    response = post(system, "/tokenize", {"model": model, "prompt": text})
    assert response.status_code == 200
    body = response.json()
    expected = tokenizer.encode(text)  # the BOS included (add_special_tokens)
    max_len = httpx.get(f"{system.http_url}/v1/models").json()["data"][0]["max_model_len"]
    assert body == {"count": len(expected), "max_model_len": max_len, "tokens": expected,
                    "token_strs": None}  # fmt: skip
    client = openai_client(system)
    by_text = client.completions.create(model=model, prompt=text, **GREEDY)
    by_ids = client.completions.create(model=model, prompt=body["tokens"], **GREEDY)
    assert by_text.usage is not None and by_text.usage.prompt_tokens == body["count"]
    assert by_text.choices[0].text == by_ids.choices[0].text
    with_strs = post(system, "/tokenize", {"prompt": text, "return_token_strs": True}).json()
    assert with_strs["token_strs"] == tokenizer.convert_ids_to_tokens(expected)
    wait_until(lambda: idle(system), 5.0, "blocks free after the requests")


def test_tokenize_messages_gives_the_ids_a_chat_prefills(
    system: LocalSystem, tokenizer: Any
) -> None:
    model = model_of(system)
    body = {"model": model, "messages": MESSAGES, "add_generation_prompt": True,
            "continue_final_message": False, "add_special_tokens": False,
            "chat_template_kwargs": {}}  # fmt: skip
    response = post(system, "/tokenize", body)
    assert response.status_code == 200
    tokens = response.json()["tokens"]
    assert tokens == template_ids(tokenizer, MESSAGES)
    assert response.json()["count"] == len(tokens)
    chat = openai_client(system).chat.completions.create(model=model, messages=MESSAGES, **GREEDY)
    assert chat.usage is not None and chat.usage.prompt_tokens == len(tokens)
    wait_until(lambda: idle(system), 5.0, "blocks free after the requests")


def test_detokenize_round_trips_what_tokenize_gave(system: LocalSystem, tokenizer: Any) -> None:
    text = "round ✓ trip"
    tokens = post(system, "/tokenize", {"prompt": text}).json()["tokens"]
    response = post(system, "/detokenize", {"model": model_of(system), "tokens": tokens})
    assert response.status_code == 200
    assert response.json() == {"prompt": tokenizer.decode(tokens)}  # special tokens kept
    assert response.json()["prompt"].endswith(text)
    chat = post(system, "/tokenize", {"messages": MESSAGES}).json()["tokens"]
    rendered = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    assert post(system, "/detokenize", {"tokens": chat}).json() == {"prompt": rendered}
    assert post(system, "/detokenize", {"tokens": []}).json() == {"prompt": ""}


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/tokenize", {}, "prompt"),
        ("/tokenize", {"prompt": 5}, "prompt"),
        ("/tokenize", {"prompt": "a", "model": 3}, "model"),
        ("/tokenize", {"prompt": "a", "return_token_strs": "yes"}, "return_token_strs"),
        ("/tokenize", {"prompt": "a", "add_special_tokens": "no"}, "add_special_tokens"),
        ("/tokenize", {"messages": []}, "messages"),
        ("/tokenize", {"messages": [{"content": "x"}]}, "messages[0].role"),
        ("/tokenize", {"messages": MESSAGES, "add_generation_prompt": 0},
         "add_generation_prompt"),
        ("/tokenize", {"messages": MESSAGES, "continue_final_message": True},
         "continue_final_message"),
        ("/tokenize", {"messages": MESSAGES, "chat_template": "{{ x }}"}, "chat_template"),
        ("/tokenize", {"messages": MESSAGES, "chat_template_kwargs": [1]},
         "chat_template_kwargs"),
        ("/detokenize", {}, "tokens"),
        ("/detokenize", {"tokens": "12"}, "tokens"),
        ("/detokenize", {"tokens": [1, -1]}, "tokens[1]"),
        ("/detokenize", {"tokens": [1.5]}, "tokens[0]"),
        ("/detokenize", {"tokens": [2**31]}, "tokens[0]"),
    ],
)  # fmt: skip
def test_bad_input_is_a_400_naming_the_field(
    system: LocalSystem, path: str, body: dict[str, Any], param: str
) -> None:
    response = post(system, path, body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["message"].startswith(param)
    assert error["type"] == "invalid_request_error"


def test_not_json_unknown_model_and_too_many_ids(system: LocalSystem) -> None:
    for path in ("/tokenize", "/detokenize"):
        response = httpx.post(f"{system.http_url}{path}", content=b"{nope", timeout=10)
        assert response.status_code == 400
        response = post(system, path, {"model": "other", "prompt": "a", "tokens": [1]})
        assert response.status_code == 404
        assert response.json()["error"]["code"] == "model_not_found"
    max_len = httpx.get(f"{system.http_url}/v1/models").json()["data"][0]["max_model_len"]
    response = post(system, "/detokenize", {"tokens": [1] * (max_len + 1)})  # the worker's bound
    assert response.status_code == 400 and response.json()["error"]["param"] == "tokens"


def test_version_and_ping(system: LocalSystem) -> None:
    from importlib.metadata import version

    response = httpx.get(f"{system.http_url}/version", timeout=5)
    assert (response.status_code, response.json()) == (200, {"version": version("kvmesh")})
    for method in ("GET", "POST"):
        response = httpx.request(method, f"{system.http_url}/ping", timeout=5)
        assert (response.status_code, response.json()) == (200, {"status": "ok"})


def test_streamed_chat_sends_each_choices_role_first(system: LocalSystem) -> None:
    stream = openai_client(system).chat.completions.create(
        model=model_of(system), messages=MESSAGES, n=2, seed=3, temperature=0.9, max_tokens=4,
        stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
    )  # fmt: skip
    chunks = list(stream)
    firsts = [c.choices[0] for c in chunks[:2]]
    assert [c.index for c in firsts] == [0, 1]
    for choice in firsts:
        assert (choice.delta.role, choice.delta.content) == ("assistant", "")
        assert choice.finish_reason is None and choice.logprobs is None
    assert all(c.usage is None for c in chunks[:-1])
    texts = chunks[2:-1]
    assert texts and all(len(c.choices) == 1 and c.choices[0].delta.role is None for c in texts)
    for index in (0, 1):
        mine = [c.choices[0] for c in texts if c.choices[0].index == index]
        assert [c.finish_reason for c in mine][-1] == "length"
        assert all(c.finish_reason is None for c in mine[:-1])
    last = chunks[-1]
    assert last.choices == [] and last.usage is not None
    assert last.usage.completion_tokens == 2 * 4
    wait_until(lambda: idle(system), 5.0, "blocks free after the stream")
