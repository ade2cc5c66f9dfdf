"""Chat prompts through a real control plane and colocated worker: rendered with the model's own
chat template (ids equal transformers' `apply_chat_template`), token text in logprobs, errors
naming the field, and the no-template model refusing chat."""

from __future__ import annotations

import asyncio
import json
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from svc_harness import (
    NUM_BLOCKS,
    LoopThread,
    RunningWorker,
    engine_config,
    start_worker,
    svc_loop,
    svc_model_dir,
    wait_until,
)
from transformers import AutoTokenizer

from control_plane.config import ControlConfig
from control_plane.server import ControlServer
from decode_svc.colocated import install
from kvmesh.client import AsyncClient, Client, InvalidArgument
from kvmesh.models.tokenizer import BOS_TOKEN_ID, set_chat_template
from kvmesh.service.agent import ControlAgent
from kvmesh.service.process import worker_info
from kvmesh.v1 import generation_pb2, generation_pb2_grpc, worker_pb2, worker_pb2_grpc

__all__ = ["svc_loop", "svc_model_dir"]
MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Grüße, 世界 👋"},
]
GREEDY: dict[str, Any] = {"max_tokens": 8, "temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def chat_model_dir(svc_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with a chat template."""
    out = tmp_path_factory.mktemp("chat") / "tiny-chat"
    shutil.copytree(svc_model_dir, out)
    set_chat_template(out)
    return out


@pytest.fixture(scope="module")
def system(svc_loop: LoopThread, chat_model_dir: Path) -> Iterator[tuple[str, RunningWorker]]:
    """A control plane with one registered colocated worker serving the chat model."""

    async def start_control() -> ControlServer:
        config = ControlConfig(host="127.0.0.1", port=0, internal_port=0, drain_seconds=1.0)
        server = ControlServer(config)
        await server.start()
        return server

    control = svc_loop.run(start_control())
    worker = start_worker(svc_loop, engine_config(chat_model_dir), "colocated", install)
    info = worker_info(worker.runtime, "colocated", worker.address, worker.role)
    agent = ControlAgent(control.internal_address, info, worker.runtime, worker.role)

    async def start_agent() -> None:
        agent.start()

    try:
        svc_loop.run(start_agent())
        registry = control.cluster.registry
        wait_until(lambda: len(registry.alive()) == 1, 10.0, "the worker registered")
        yield control.address, worker
    finally:
        svc_loop.run(agent.stop())
        worker.stop()
        svc_loop.run(control.stop())


@pytest.fixture(scope="module")
def client(system: tuple[str, RunningWorker]) -> Iterator[Client]:
    with Client(system[0], timeout=60) as c:
        yield c


def template_ids(model_dir: Path, messages: list[dict[str, str]]) -> list[int]:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def test_chat_ids_are_the_templates_and_generate_like_token_ids(
    client: Client, system: tuple[str, RunningWorker], chat_model_dir: Path
) -> None:
    expected = template_ids(chat_model_dir, MESSAGES)
    assert expected[0] == BOS_TOKEN_ID and expected.count(BOS_TOKEN_ID) == 1
    stub = worker_pb2_grpc.PrefillServiceStub(system[1].channel)
    request = generation_pb2.GenerateRequest(request_id="prep", chat=_chat(MESSAGES))
    prepared = stub.Prepare(worker_pb2.PrepareRequest(request=request), timeout=10).request
    assert list(prepared.prompt_ids) == expected
    chat = client.complete_chat(MESSAGES, **GREEDY)
    plain = client.complete(expected, **GREEDY)
    assert len(chat.token_ids) == GREEDY["max_tokens"]
    assert (chat.token_ids, chat.text) == (plain.token_ids, plain.text)
    assert chat.usage is not None and chat.usage.prompt_tokens == len(expected)
    assert client.model_info().has_chat_template


def test_a_messages_name_reaches_the_workers_template(
    client: Client, system: tuple[str, RunningWorker], chat_model_dir: Path
) -> None:
    """A message's `name` travels the wire (client, control plane, worker) into the chat
    template; a name longer than a role may be is refused naming it."""
    named = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi",
             "name": "ann"}]  # fmt: skip
    expected = template_ids(chat_model_dir, named)
    assert expected != template_ids(chat_model_dir, [named[0], {"role": "user", "content": "hi"}])
    stub = worker_pb2_grpc.PrefillServiceStub(system[1].channel)
    request = generation_pb2.GenerateRequest(request_id="named", chat=_chat(named))
    prepared = stub.Prepare(worker_pb2.PrepareRequest(request=request), timeout=10).request
    assert list(prepared.prompt_ids) == expected
    result = client.complete_chat(named, **GREEDY)
    assert result.usage is not None and result.usage.prompt_tokens == len(expected)
    with pytest.raises(InvalidArgument, match=r"prompt\.chat\.messages\[0\]\.name"):
        client.complete_chat([{"role": "user", "content": "hi", "name": "n" * 300}], **GREEDY)


def test_async_client_chat_streams_the_same(client: Client) -> None:
    expected = client.complete_chat(MESSAGES, **GREEDY)

    async def run() -> tuple[list[Any], Any]:
        async with AsyncClient(client.target, timeout=60) as aclient:
            chunks = [c async for c in aclient.chat(MESSAGES, **GREEDY)]
            return chunks, await aclient.complete_chat(MESSAGES, **GREEDY)

    chunks, result = asyncio.run(run())
    assert [t for c in chunks for t in c.token_ids] == expected.token_ids
    assert "".join(c.text for c in chunks) == expected.text
    assert (result.token_ids, result.text) == (expected.token_ids, expected.text)


def test_logprobs_carry_each_tokens_text(
    system: tuple[str, RunningWorker], chat_model_dir: Path
) -> None:
    tokenizer = AutoTokenizer.from_pretrained(chat_model_dir)
    sampling = generation_pb2.SamplingParams(**GREEDY, logprobs=3)
    request = generation_pb2.GenerateRequest(chat=_chat(MESSAGES), sampling=sampling)
    with grpc.insecure_channel(system[0]) as channel:
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        logprobs = [lp for r in stub.Generate(request, timeout=60) for lp in r.logprobs]
    assert len(logprobs) == GREEDY["max_tokens"]
    for lp in logprobs:
        assert lp.token == tokenizer.decode([lp.token_id], skip_special_tokens=False)
        assert len(lp.top_tokens) == len(lp.top_token_ids) == 3
        assert list(lp.top_tokens) == [tokenizer.decode([i]) for i in lp.top_token_ids]
        assert len(lp.top_token_bytes) == 3
    joined = b"".join(lp.token_bytes for lp in logprobs)  # each token's own bytes, in order
    text = tokenizer.decode([lp.token_id for lp in logprobs], skip_special_tokens=False)
    assert joined.decode(errors="replace") == text


BAD_CHAT = [
    ([], "prompt.chat.messages"),
    ([{"role": "", "content": "hi"}], r"prompt.chat.messages\[0\].role"),
    ([{"role": "user", "content": "hi"}, {"role": "", "content": "x"}], r"messages\[1\].role"),
    ([{"role": "user", "content": "x" * 9000}], "prompt.chat.messages"),
]


@pytest.mark.parametrize(("messages", "field"), BAD_CHAT, ids=[f for _, f in BAD_CHAT])
def test_bad_chat_is_invalid_argument_naming_the_field(
    system: tuple[str, RunningWorker], messages: list[dict[str, str]], field: str
) -> None:
    request = generation_pb2.GenerateRequest(chat=_chat(messages))
    with grpc.insecure_channel(system[0]) as channel:
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        with pytest.raises(grpc.RpcError) as info:
            list(stub.Generate(request, timeout=30))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert re.search(field, info.value.details() or ""), info.value.details()
    assert system[1].free_blocks() == NUM_BLOCKS


def test_overlong_text_is_refused_before_tokenizing(client: Client) -> None:
    with pytest.raises(InvalidArgument, match=r"prompt\.text"):
        client.complete("y" * 9000, max_tokens=1)


def test_model_without_template_refuses_chat(svc_loop: LoopThread, svc_model_dir: Path) -> None:
    worker = start_worker(svc_loop, engine_config(svc_model_dir), "colocated", install)
    try:
        assert not worker.runtime.model.has_chat_template
        stub = worker_pb2_grpc.PrefillServiceStub(worker.channel)
        request = generation_pb2.GenerateRequest(request_id="c", chat=_chat(MESSAGES))
        with pytest.raises(grpc.RpcError) as info:
            stub.Prepare(worker_pb2.PrepareRequest(request=request), timeout=10)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert (info.value.details() or "").startswith("prompt.chat: this model has no chat")
    finally:
        worker.stop()


def _chat(messages: list[dict[str, str]]) -> generation_pb2.ChatMessages:
    return generation_pb2.ChatMessages(messages=[generation_pb2.ChatMessage(**m) for m in messages])


def test_cli_generate_chat_remote(
    client: Client, system: tuple[str, RunningWorker], capsys: pytest.CaptureFixture[str]
) -> None:
    from kvmesh.cli.main import build_parser

    system_text, question = MESSAGES[0]["content"], MESSAGES[1]["content"]
    argv = ["generate", "--target", system[0], "--chat", question, "--system", system_text]
    flags = ["--temperature", "0", "--max-tokens", "8", "--ignore-eos", "--json"]
    args = build_parser().parse_args([*argv, *flags])
    assert args.func(args) == 0
    line = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    expected = client.complete_chat(MESSAGES, **GREEDY)
    assert (line["token_ids"], line["text"]) == (expected.token_ids, expected.text)
