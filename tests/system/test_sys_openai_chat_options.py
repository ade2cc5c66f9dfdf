"""vLLM's chat template options on a real `kvmesh up` (1 prefill + 1 decode worker, loopback) on
the tiny test model whose chat template reads `enable_thinking` and `documents` and raises on a
bad `mode`: `add_generation_prompt`, `continue_final_message`, `add_special_tokens`,
`chat_template_kwargs` and `documents` render exactly what transformers' apply_chat_template
renders with the same arguments, on /tokenize's chat form, /v1/chat/completions (through the
official `openai` client's `extra_body`, as vLLM's clients send them) and the gRPC API (raw,
and through `kvmesh.client`'s chat keywords of the same names); a
completion's `add_special_tokens: false` leaves out the BOS; bad values are a 400 (gRPC:
INVALID_ARGUMENT) naming the field."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import openai
import pytest
from sys_harness import idle, local_system, openai_client, wait_until

from kvmesh.cli.up import LocalSystem
from kvmesh.client import AsyncClient, Client, InvalidArgument
from kvmesh.v1 import generation_pb2, generation_pb2_grpc

# BOS, any documents, each message as `<|role|>\ncontent\n`, the assistant's header with the
# generation prompt, and an empty thinking block after it when enable_thinking is false.
TEMPLATE = (
    "{% if mode is defined and mode not in ['a', 'b'] %}"
    "{{ raise_exception('mode must be a or b') }}{% endif %}"
    "{{ bos_token }}{% for d in documents or [] %}<|doc|>{{ d['title'] }}: {{ d['text'] }}\n"
    "{% endfor %}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think></think>\n{% endif %}"
    "{% endif %}"
)
MESSAGES: Any = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "héllo ✓"}]
PARTIAL: Any = [*MESSAGES, {"role": "assistant", "content": "Sure, "}]
DOCUMENTS = [{"title": "T1", "text": "one"}, {"title": "T2", "text": "two"}]
GREEDY: dict[str, Any] = {"max_tokens": 6, "temperature": 0.0}
DEEP: Any = [1]
for _ in range(40):
    DEEP = [DEEP]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    from kvmesh.models.tiny import build_tiny_model
    from kvmesh.models.tokenizer import set_chat_template

    folder: Path = tmp_path_factory.mktemp("tiny-thinking")
    build_tiny_model(folder, "llama", "test", 0)
    set_chat_template(folder, TEMPLATE)
    return str(folder)


@pytest.fixture(scope="module")
def system(model_dir: str) -> Iterator[LocalSystem]:
    with local_system(model=model_dir, http_port=0) as (started, _):
        yield started


@pytest.fixture(scope="module")
def tokenizer(model_dir: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def tokenize(system: LocalSystem, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{system.http_url}/tokenize", json=body, timeout=30)


def expected_ids(
    tokenizer: Any, messages: Any, add_special_tokens: bool = False, **kwargs: Any
) -> list[int]:
    """transformers' rendering with these apply_chat_template arguments (the generation prompt
    unless told otherwise), tokenized as vLLM tokenizes it."""
    kwargs.setdefault("add_generation_prompt", True)
    text = tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)
    return list(tokenizer.encode(text, add_special_tokens=add_special_tokens))


# (name, vLLM request fields, messages, apply_chat_template arguments)
CASES: list[tuple[str, dict[str, Any], Any, dict[str, Any]]] = [
    ("default", {}, MESSAGES, {}),
    ("no generation prompt", {"add_generation_prompt": False}, MESSAGES,
     {"add_generation_prompt": False}),
    ("continue final message", {"add_generation_prompt": False, "continue_final_message": True},
     PARTIAL, {"add_generation_prompt": False, "continue_final_message": True}),
    ("add special tokens", {"add_special_tokens": True}, MESSAGES, {"add_special_tokens": True}),
    ("thinking off", {"chat_template_kwargs": {"enable_thinking": False}}, MESSAGES,
     {"enable_thinking": False}),
    ("thinking on", {"chat_template_kwargs": {"enable_thinking": True}}, MESSAGES,
     {"enable_thinking": True}),
    ("unread variable", {"chat_template_kwargs": {"unread": [1, {"x": None}]}}, MESSAGES, {}),
    ("documents in the variables", {"chat_template_kwargs": {"documents": DOCUMENTS}}, MESSAGES,
     {"documents": DOCUMENTS}),
    ("variables the request overrides",
     {"chat_template_kwargs": {"add_generation_prompt": False, "continue_final_message": True,
                               "tokenize": True, "max_length": 2}}, MESSAGES, {}),
]  # fmt: skip


@pytest.mark.parametrize(("fields", "messages", "arguments"), [c[1:] for c in CASES],
                         ids=[c[0] for c in CASES])  # fmt: skip
def test_tokenize_and_chat_render_as_apply_chat_template(
    system: LocalSystem, tokenizer: Any, fields: dict[str, Any], messages: Any,
    arguments: dict[str, Any],
) -> None:  # fmt: skip
    """/tokenize's ids are transformers' with the same arguments, and a chat completion with the
    same fields prefills exactly them: its prompt_tokens count them and its greedy text is the
    completion of those ids."""
    expected = expected_ids(tokenizer, messages, **arguments)
    response = tokenize(system, {"messages": messages, **fields})
    assert response.status_code == 200, response.text
    assert response.json()["tokens"] == expected
    client = openai_client(system)
    model = client.models.list().data[0].id
    chat = client.chat.completions.create(
        model=model, messages=messages, extra_body={**fields, "ignore_eos": True}, **GREEDY
    )
    assert chat.usage is not None and chat.usage.prompt_tokens == len(expected)
    by_ids = client.completions.create(
        model=model, prompt=expected, extra_body={"ignore_eos": True}, **GREEDY
    )
    assert chat.choices[0].message.content == by_ids.choices[0].text
    wait_until(lambda: idle(system), 5.0, "blocks free after the requests")


def test_each_option_changes_the_ids_as_it_should(system: LocalSystem, tokenizer: Any) -> None:
    def ids(messages: Any = MESSAGES, **fields: Any) -> list[int]:
        response = tokenize(system, {"messages": messages, **fields})
        assert response.status_code == 200, response.text
        return list(response.json()["tokens"])

    default, header = ids(), tokenizer.encode("<|assistant|>\n", add_special_tokens=False)
    assert default[: -len(header)] == ids(add_generation_prompt=False)
    assert default[-len(header) :] == header
    assert ids(add_special_tokens=True) == [tokenizer.bos_token_id, *default]  # BOS twice
    thinking = tokenizer.encode("<think></think>\n", add_special_tokens=False)
    assert ids(chat_template_kwargs={"enable_thinking": False}) == default + thinking
    partial = ids(PARTIAL, add_generation_prompt=False, continue_final_message=True)
    assert partial == default + tokenizer.encode("Sure, ", add_special_tokens=False)
    closed = ids(PARTIAL, add_generation_prompt=False)
    assert closed == partial + tokenizer.encode("\n", add_special_tokens=False)  # turn ended
    docs = ids(chat_template_kwargs={"documents": DOCUMENTS})
    assert docs[0] == default[0] and docs[-len(default) + 1 :] == default[1:]
    assert tokenizer.decode(docs[1 : -len(default) + 1]) == "<|doc|>T1: one\n<|doc|>T2: two\n"


def test_documents_reach_the_chat_template_of_a_chat(system: LocalSystem, tokenizer: Any) -> None:
    """vLLM's chat `documents` (its /tokenize has no such field and ignores it, as vLLM does);
    the request's documents win over the template variables'."""
    client = openai_client(system)
    model = client.models.list().data[0].id
    for extra, documents in (
        ({"documents": DOCUMENTS}, DOCUMENTS),
        ({"documents": DOCUMENTS[:1], "chat_template_kwargs": {"documents": DOCUMENTS}},
         DOCUMENTS[:1]),
    ):  # fmt: skip
        chat = client.chat.completions.create(model=model, messages=MESSAGES, extra_body=extra,
                                              **GREEDY)  # fmt: skip
        expected = expected_ids(tokenizer, MESSAGES, documents=documents)
        assert chat.usage is not None and chat.usage.prompt_tokens == len(expected)
    ignored = tokenize(system, {"messages": MESSAGES, "documents": DOCUMENTS}).json()["tokens"]
    assert ignored == expected_ids(tokenizer, MESSAGES)


def test_completion_without_special_tokens_has_no_bos(system: LocalSystem, tokenizer: Any) -> None:
    client = openai_client(system)
    model, text = client.models.list().data[0].id, "héllo there"
    plain = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.encode(text) == [tokenizer.bos_token_id, *plain]
    for special, expected in ((None, [tokenizer.bos_token_id, *plain]), (True, None),
                              (False, plain)):  # fmt: skip
        expected = expected or [tokenizer.bos_token_id, *plain]
        extra = {} if special is None else {"add_special_tokens": special}
        response = tokenize(system, {"prompt": text, **extra})
        assert response.json()["tokens"] == expected
        completion = client.completions.create(
            model=model, prompt=text, extra_body={**extra, "ignore_eos": True}, **GREEDY
        )
        assert completion.usage is not None and completion.usage.prompt_tokens == len(expected)


@pytest.mark.parametrize(
    ("fields", "param", "says"),
    [
        ({"continue_final_message": True}, "continue_final_message", "add_generation_prompt"),
        ({"continue_final_message": True, "add_generation_prompt": True},
         "continue_final_message", "add_generation_prompt"),
        ({"chat_template": "{{ 'x' }}"}, "chat_template", "--trust-request-chat-template"),
        ({"chat_template_kwargs": {"chat_template": "x"}}, "chat_template_kwargs",
         "--trust-request-chat-template"),
        ({"chat_template_kwargs": [1]}, "chat_template_kwargs", "object"),
        ({"chat_template_kwargs": {"mode": "c"}}, "chat_template_kwargs", "mode must be a or b"),
        ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs", "messages"),
        ({"chat_template_kwargs": {"x": DEEP}},
         "chat_template_kwargs", "deeper"),
        ({"add_generation_prompt": "no"}, "add_generation_prompt", "boolean"),
        ({"add_special_tokens": 1}, "add_special_tokens", "boolean"),
    ],
)  # fmt: skip
def test_bad_options_are_a_400_naming_the_field(
    system: LocalSystem, fields: dict[str, Any], param: str, says: str
) -> None:
    """On the chat endpoint (the openai client raises BadRequestError) and /tokenize alike; a
    template that raises on the variables is refused for that request alone."""
    client = openai_client(system)
    model = client.models.list().data[0].id
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=model, messages=MESSAGES, extra_body=fields,
                                       **GREEDY)  # fmt: skip
    error = caught.value.body
    assert isinstance(error, dict) and error["param"] == param, error
    assert error["message"].startswith(param) and says in error["message"]
    response = tokenize(system, {"messages": MESSAGES, **fields})
    assert response.status_code == 400 and response.json()["error"]["param"] == param
    fine = client.chat.completions.create(
        model=model, messages=MESSAGES, extra_body={"ignore_eos": True}, **GREEDY
    )
    assert fine.choices[0].finish_reason == "length"
    wait_until(lambda: idle(system), 5.0, "blocks free after the requests")


def grpc_generate(system: LocalSystem, request: generation_pb2.GenerateRequest) -> int:
    """The prompt's length in tokens of a gRPC Generate of `request` (run to the end)."""
    request.sampling.max_tokens = 2
    with grpc.insecure_channel(system.endpoint) as channel:
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        responses = list(stub.Generate(request, timeout=30))
    return responses[-1].prompt_tokens


def test_grpc_chat_options_render_and_are_validated(system: LocalSystem, tokenizer: Any) -> None:
    """GenerateRequest's ChatMessages fields render as the HTTP fields do; bad ones are
    INVALID_ARGUMENT naming the wire field; unset fields render as before they existed."""

    def chat(messages: Any = MESSAGES, **fields: Any) -> generation_pb2.GenerateRequest:
        wire = generation_pb2.ChatMessages(**fields)
        for m in messages:
            wire.messages.add(role=m["role"], content=m["content"])
        return generation_pb2.GenerateRequest(chat=wire)

    assert grpc_generate(system, chat()) == len(expected_ids(tokenizer, MESSAGES))
    options = {"add_generation_prompt": False, "continue_final_message": True,
               "add_special_tokens": True, "template_kwargs": json.dumps({"enable_thinking": 0}),
               "documents": json.dumps(DOCUMENTS)}  # fmt: skip
    expected = expected_ids(tokenizer, PARTIAL, True, add_generation_prompt=False,
                            continue_final_message=True, documents=DOCUMENTS)  # fmt: skip
    assert grpc_generate(system, chat(PARTIAL, **options)) == len(expected)
    text = generation_pb2.GenerateRequest(text="héllo", add_special_tokens=False)
    assert grpc_generate(system, text) == len(tokenizer.encode("héllo", add_special_tokens=False))
    bad = [
        (chat(continue_final_message=True), "prompt.chat.continue_final_message"),
        (chat(template_kwargs="[1]"), "prompt.chat.template_kwargs"),
        (chat(template_kwargs="{"), "prompt.chat.template_kwargs"),
        (chat(template_kwargs='{"mode": "z"}'), "prompt.chat.template_kwargs"),
        (chat(template_kwargs='{"chat_template": "x"}'), "prompt.chat.template_kwargs"),
        (chat(template_kwargs="{}" + " " * 70000), "prompt.chat.template_kwargs"),
        (chat(documents='[{"title": 1}]'), r"prompt.chat.documents\[0\]"),
        (chat(documents="{}"), "prompt.chat.documents"),
        (generation_pb2.GenerateRequest(chat=chat().chat, add_special_tokens=True),
         "add_special_tokens"),
    ]  # fmt: skip
    for request, field in bad:
        with pytest.raises(grpc.RpcError) as caught:
            grpc_generate(system, request)
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert field.replace("\\", "") in (caught.value.details() or ""), caught.value.details()
    wait_until(lambda: idle(system), 5.0, "blocks free after the requests")


@pytest.mark.parametrize(("fields", "messages", "arguments"), [c[1:] for c in CASES],
                         ids=[c[0] for c in CASES])  # fmt: skip
def test_the_python_client_sends_each_option(
    system: LocalSystem, tokenizer: Any, fields: dict[str, Any], messages: Any,
    arguments: dict[str, Any],
) -> None:  # fmt: skip
    """`kvmesh.client`'s chat calls take vLLM's field names as keywords and set ChatMessages'
    fields: the server prefills exactly transformers' ids for the same arguments (its
    prompt_tokens), and the greedy text is the completion of those ids."""
    expected = expected_ids(tokenizer, messages, **arguments)
    with Client(system.endpoint, timeout=30) as client:
        chat = client.complete_chat(messages, **fields, **GREEDY, ignore_eos=True)
        by_ids = client.complete(expected, **GREEDY, ignore_eos=True)
    assert chat.usage is not None and chat.usage.prompt_tokens == len(expected)
    assert (chat.token_ids, chat.text) == (by_ids.token_ids, by_ids.text)
    wait_until(lambda: idle(system), 5.0, "blocks free after the requests")


def test_the_python_clients_documents_text_and_async_calls(
    system: LocalSystem, tokenizer: Any
) -> None:
    """`documents` (winning over the variables'), a text prompt's `add_special_tokens=False`,
    and AsyncClient's chat and complete_chat with the same keywords."""
    with Client(system.endpoint, timeout=30) as client:
        for documents, variables in ((DOCUMENTS, None), ([], {"documents": DOCUMENTS})):
            result = client.complete_chat(MESSAGES, documents=documents,
                                          chat_template_kwargs=variables, **GREEDY)  # fmt: skip
            expected = expected_ids(tokenizer, MESSAGES, documents=documents)
            assert result.usage is not None and result.usage.prompt_tokens == len(expected)
        for special, expected in (
            (None, tokenizer.encode("héllo")),
            (False, tokenizer.encode("héllo", add_special_tokens=False)),
        ):
            result = client.complete("héllo", add_special_tokens=special, **GREEDY)
            assert result.usage is not None and result.usage.prompt_tokens == len(expected)
    options: dict[str, Any] = {"add_generation_prompt": False, "continue_final_message": True,
                               "add_special_tokens": True,
                               "chat_template_kwargs": {"enable_thinking": False}}  # fmt: skip
    expected = expected_ids(tokenizer, PARTIAL, True, add_generation_prompt=False,
                            continue_final_message=True)  # fmt: skip

    async def run() -> tuple[int, int]:
        async with AsyncClient(system.endpoint, timeout=30) as client:
            result = await client.complete_chat(PARTIAL, **options, **GREEDY)
            chunks = [c async for c in client.chat(PARTIAL, **options, **GREEDY)]
        last = chunks[-1].usage
        assert result.usage is not None and last is not None
        return result.usage.prompt_tokens, last.prompt_tokens

    assert asyncio.run(run()) == (len(expected), len(expected))
    wait_until(lambda: idle(system), 5.0, "blocks free after the requests")


@pytest.mark.parametrize(
    ("keywords", "error", "says"),
    [
        ({"add_generation_prompt": "no"}, TypeError, "add_generation_prompt"),
        ({"add_special_tokens": 1}, TypeError, "add_special_tokens"),
        ({"chat_template_kwargs": [1]}, TypeError, "chat_template_kwargs"),
        ({"chat_template_kwargs": {"x": float("nan")}}, ValueError, "chat_template_kwargs"),
        ({"chat_template_kwargs": {"x": object()}}, ValueError, "chat_template_kwargs"),
        ({"documents": "one"}, TypeError, "documents"),
        ({"chat_template": "{{ 'x' }}"}, TypeError, "chat_template is not supported"),
        ({"tools": [{"type": "function"}]}, TypeError, "tools is not supported"),
        ({"continue_final_message": True}, InvalidArgument, "prompt.chat.continue_final_message"),
        ({"chat_template_kwargs": {"mode": "z"}}, InvalidArgument, "prompt.chat.template_kwargs"),
        ({"chat_template_kwargs": {"chat_template": "x"}}, InvalidArgument,
         "prompt.chat.template_kwargs.chat_template"),
        ({"documents": [{"title": 1}]}, InvalidArgument, "prompt.chat.documents[0]"),
    ],
)  # fmt: skip
def test_the_python_clients_bad_options_raise_clearly(
    system: LocalSystem, keywords: dict[str, Any], error: type[Exception], says: str
) -> None:
    """Bad types are refused before sending (TypeError, or ValueError for what JSON cannot hold,
    naming the keyword); the server's refusals are InvalidArgument naming the wire field."""
    with Client(system.endpoint, timeout=30) as client:
        with pytest.raises(error) as caught:
            client.complete_chat(MESSAGES, **keywords, **GREEDY)
        assert says in str(caught.value), caught.value
        with pytest.raises(TypeError, match="option of a chat call"):
            client.complete("héllo", continue_final_message=True)
        with pytest.raises(InvalidArgument, match="add_special_tokens"):
            client.complete(MESSAGES, add_special_tokens=True, **GREEDY)  # a text prompt's
    wait_until(lambda: idle(system), 5.0, "blocks free after the requests")
