"""Bounded work on a real local system (control plane + prefill + decode processes): huge and
large prompts are refused quickly, naming the field, while concurrent streams go on unharmed
and the prefill worker stays registered (its heartbeats never stop: tokenizing runs in a
thread); undecodable requests are INVALID_ARGUMENT at the front door and at a worker port
(presenting the run's cluster token; without it the worker answers UNAUTHENTICATED first)."""

from __future__ import annotations

import json
import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_status import rpc_status
from sys_harness import idle, live_workers, local_system, wait_until

from kvmesh.cli.up import LocalSystem
from kvmesh.client import Client, InvalidArgument, Prompt, ResourceExhausted

LONG_CONTEXT = 65536  # 1 MiB of text passes the worker's size bound and is tokenized
MIB = 1 << 20


@pytest.fixture(scope="module")
def long_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny test model with a 64 Ki-token context (the weights are position-free)."""
    from kvmesh.models.tiny import tiny_model_path
    from kvmesh.models.tokenizer import set_chat_template

    model = tmp_path_factory.mktemp("long") / "model"
    shutil.copytree(tiny_model_path(), model)
    config = json.loads((model / "config.json").read_text())
    config["max_position_embeddings"] = LONG_CONTEXT
    (model / "config.json").write_text(json.dumps(config))
    set_chat_template(model)
    return model


@pytest.fixture(scope="module")
def system(long_model: Path) -> Iterator[tuple[LocalSystem, str]]:
    with local_system(model=str(long_model)) as started:
        yield started


class Streams:
    """Threads running short greedy requests one after another until stopped, recording
    failures and the longest wait between two chunks of one stream."""

    def __init__(self, endpoint: str, count: int = 3) -> None:
        self.endpoint, self.stop = endpoint, threading.Event()
        self.errors: list[str] = []
        self.completed = 0
        self.longest_gap = 0.0
        self.threads = [threading.Thread(target=self._run, daemon=True) for _ in range(count)]

    def __enter__(self) -> Streams:
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(30)

    def _run(self) -> None:
        with Client(self.endpoint, timeout=30) as client:
            while not self.stop.is_set():
                last = time.monotonic()
                try:
                    for _chunk in client.generate([1, 2, 3], max_tokens=24, ignore_eos=True):
                        now = time.monotonic()
                        self.longest_gap = max(self.longest_gap, now - last)
                        last = now
                    self.completed += 1
                except Exception as error:
                    self.errors.append(repr(error))


class Registered:
    """A poller of the control plane's live prefill count; `lowest` is the minimum seen."""

    def __init__(self, system: LocalSystem) -> None:
        self.system, self.lowest = system, 1.0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Registered:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(10)

    def _run(self) -> None:
        while not self.stop.wait(0.05):
            self.lowest = min(self.lowest, live_workers(self.system, "prefill"))


def refuse_many(endpoint: str, prompt: Prompt, count: int) -> list[tuple[type, str, float]]:
    """Send `count` copies of a prompt at once; each outcome (error type, message, seconds)."""
    results: list[tuple[type, str, float]] = []

    def one() -> None:
        started = time.monotonic()
        with Client(endpoint, timeout=60) as client:
            try:
                client.complete(prompt, max_tokens=4)
                results.append((type(None), "", time.monotonic() - started))
            except Exception as error:
                results.append((type(error), str(error), time.monotonic() - started))

    threads = [threading.Thread(target=one) for _ in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(90)
    return results


def test_huge_and_large_prompts_are_refused_while_streams_go_on(
    system: tuple[LocalSystem, str],
) -> None:
    local, endpoint = system
    with Streams(endpoint) as streams, Registered(local) as registered:
        wait_until(lambda: streams.completed >= 3, 30, "streams running")
        with Client(endpoint, timeout=30) as client:
            started = time.monotonic()
            with pytest.raises(ResourceExhausted):  # beyond the 4 MiB message limit
                client.complete("x" * (8 * MIB), max_tokens=4)
            assert time.monotonic() - started < 2.0
        # Allowed by the byte bounds, tokenized (in a thread), refused by the token limit.
        outcomes = refuse_many(endpoint, "hello world " * (MIB // 12), 2)
        chat = [{"role": "user", "content": "hello world " * (MIB // 12)}]
        outcomes += refuse_many(endpoint, chat, 1)  # rendered with the template, tokenized
        before = streams.completed
        wait_until(lambda: streams.completed >= before + 3, 30, "streams still running")
    assert [kind for kind, _, _ in outcomes] == [InvalidArgument] * 3, outcomes
    assert all("prompt" in message and "exceed" in message for _, message, _ in outcomes)
    assert max(seconds for _, _, seconds in outcomes) < 45  # seconds of tokenizing each
    assert streams.errors == []
    assert streams.longest_gap < 2.0, streams.longest_gap  # the lease: no stream stalled that long
    assert registered.lowest == 1.0  # the prefill worker was never declared dead
    wait_until(lambda: idle(local), 10, "nothing held")


def raw_call(address: str, method: str, payload: bytes) -> grpc.RpcError:
    with grpc.insecure_channel(address) as channel:
        call = channel.unary_stream(method)(payload, timeout=10)
        with pytest.raises(grpc.RpcError) as caught:
            list(call)
    return caught.value


def bad_request_fields(error: grpc.RpcError) -> list[str]:
    status = rpc_status.from_call(error)  # type: ignore[arg-type]
    assert status is not None
    fields = []
    for detail in status.details:
        bad = error_details_pb2.BadRequest()
        if detail.Unpack(bad):
            fields += [v.field for v in bad.field_violations]
    return fields


def test_undecodable_and_bad_utf8_are_invalid_argument_at_every_door(
    system: tuple[LocalSystem, str],
) -> None:
    local, endpoint = system
    error = raw_call(endpoint, "/kvmesh.v1.GenerationService/Generate", b"\xff\xff garbage")
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT  # type: ignore[attr-defined]
    assert bad_request_fields(error) == ["request"]
    error = raw_call(endpoint, "/kvmesh.v1.GenerationService/Generate", b"\x12\x02\xc3\x28")
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT  # type: ignore[attr-defined]
    assert error.details() == "prompt.text: not valid UTF-8"  # type: ignore[attr-defined]
    prefill = next(w for w in local.workers if w.role == "prefill")
    token = (("authorization", f"Bearer {local.env['KVMESH_CLUSTER_TOKEN']}"),)
    with grpc.insecure_channel(prefill.ready["address"]) as channel:
        prepare = channel.unary_unary("/kvmesh.v1.PrefillService/Prepare")
        with pytest.raises(grpc.RpcError) as anonymous:  # the token is checked before the bytes
            prepare(b"\x0a\x04\x12\x02\xff\xfe", timeout=10)
        with pytest.raises(grpc.RpcError) as caught:
            prepare(b"\x0a\x04\x12\x02\xff\xfe", metadata=token, timeout=10)
    assert anonymous.value.code() == grpc.StatusCode.UNAUTHENTICATED  # type: ignore[attr-defined]
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT  # type: ignore[attr-defined]
    assert caught.value.details() == "request.prompt.text: not valid UTF-8"  # type: ignore[attr-defined]
    assert idle(local)


def test_worker_field_errors_reach_the_client_as_bad_request_details(
    system: tuple[LocalSystem, str],
) -> None:
    from kvmesh.client import build_request

    _, endpoint = system
    for sampling, field in [({"temperature": -1.0}, "sampling.temperature"),
                            ({"logprobs": 1000}, "sampling.logprobs")]:  # fmt: skip
        payload = build_request("hi", **sampling).SerializeToString()
        error = raw_call(endpoint, "/kvmesh.v1.GenerationService/Generate", payload)
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT  # type: ignore[attr-defined]
        assert bad_request_fields(error) == [field]
