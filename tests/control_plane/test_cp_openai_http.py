"""The OpenAI-compatible HTTP door over a real control plane and real in-test worker peers,
driven by the official `openai` client: answers, streams, errors, disconnects, drain."""

from __future__ import annotations

import asyncio
import contextlib
import json
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import openai
import pytest
from cp_harness import Harness, control_plane, run_async
from cp_workers import FakeWorker

from control_plane.openai_http.app import RunStream, first_responses, merged, numbered
from control_plane.run import RELAY_BUFFER
from kvmesh.v1 import generation_pb2

MODEL = "tiny"  # cp_fixtures' model name


def client(cp: Harness, **kwargs: Any) -> openai.AsyncOpenAI:
    assert cp.server.http is not None
    return openai.AsyncOpenAI(
        base_url=f"{cp.server.http.url}/v1", api_key="unused", max_retries=0, **kwargs
    )


def get(cp: Harness, path: str) -> tuple[int, str, str]:
    """(status, content type, body) of a GET (blocking; run in a thread)."""
    assert cp.server.http is not None
    try:
        with urllib.request.urlopen(f"{cp.server.http.url}{path}", timeout=5) as response:
            return response.status, response.headers["content-type"], response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.headers["content-type"], error.read().decode()


async def idle(cp: Harness) -> None:
    for worker in cp.workers:
        await worker.wait_empty(timeout=1.0)
    assert await cp.server.front_door.wait_idle(1.0)
    assert len(cp.server.cluster.ledger) == 0


@run_async
async def test_models_health_metrics_and_a_completion_with_usage() -> None:
    async with control_plane(http_port=0) as cp:
        status, _, body = await asyncio.to_thread(get, cp, "/health")
        assert (status, json.loads(body)["status"]) == (503, "unavailable")
        await cp.add("p0", "prefill"), await cp.add("d0", "decode")
        assert (await asyncio.to_thread(get, cp, "/health"))[0] == 200
        api = client(cp)
        models = await api.models.list()
        assert [m.id for m in models.data] == [MODEL]
        done = await api.completions.create(
            model=MODEL, prompt="hi", max_tokens=4, seed=7, user="u", extra_body={"unknown": 1}
        )
        assert done.id.startswith("cmpl-") and done.model == MODEL
        assert done.object == "text_completion"
        [choice] = done.choices
        assert (choice.index, choice.text, choice.finish_reason) == (0, "abbb", "length")
        assert done.usage is not None
        assert (done.usage.prompt_tokens, done.usage.completion_tokens) == (2, 4)
        assert done.usage.total_tokens == 6
        status, content_type, text = await asyncio.to_thread(get, cp, "/metrics")
        assert status == 200 and content_type.startswith("text/plain")
        assert 'kvmesh_control_requests_total{status="OK"} 1.0' in text
        await idle(cp)


@run_async
async def test_completion_stream_ends_with_usage_chunk_and_done() -> None:
    async with control_plane(http_port=0) as cp:
        await cp.add("c0", "colocated")
        stream = await client(cp).completions.create(
            model=MODEL, prompt=[5, 6, 7], stream=True, stream_options={"include_usage": True}
        )
        chunks = [chunk async for chunk in stream]  # the client stops at data: [DONE]
        assert "".join(c.choices[0].text for c in chunks if c.choices) == "abbb"
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
        assert len({c.id for c in chunks}) == 1
        usage = chunks[-1].usage
        assert chunks[-1].choices == [] and usage is not None
        assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (3, 4, 7)
        await idle(cp)


@run_async
async def test_chat_completion_and_chat_stream() -> None:
    async with control_plane(http_port=0) as cp:
        worker = await cp.add("c0", "colocated")
        api = client(cp)
        parts = [{"type": "text", "text": "h"}, {"type": "text", "text": "i"}]
        messages: Any = [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": parts},
        ]
        done = await api.chat.completions.create(
            model=MODEL, messages=messages, max_completion_tokens=4
        )
        assert done.id.startswith("chatcmpl-") and done.object == "chat.completion"
        assert done.choices[0].message.role == "assistant"
        assert done.choices[0].message.content == "abbb"
        assert done.usage is not None and done.usage.prompt_tokens == len("be briefh\ni")
        stream = await api.chat.completions.create(model=MODEL, messages=messages, stream=True)
        chunks = [chunk async for chunk in stream]
        assert chunks[0].object == "chat.completion.chunk"
        assert chunks[0].choices[0].delta.role == "assistant"
        assert "".join(c.choices[0].delta.content or "" for c in chunks) == "abbb"
        assert worker.calls.count("Generate") == 2
        await idle(cp)


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"prompt": "x", "temperature": "hot"}, "temperature"),
        ({"prompt": "x", "temperature": 3}, "temperature"),
        ({"prompt": "x", "n": 0}, "n"),
        ({"prompt": "x", "max_tokens": True}, "max_tokens"),
        ({"prompt": "x", "logprobs": 21}, "logprobs"),
        ({"prompt": "x", "stop": [""]}, "stop"),
        ({"prompt": ["a", ""]}, "prompt[1]"),
        ({"prompt": [1, 999]}, "prompt"),  # the worker's check, named as the request's param
        ({"prompt": [[1, 2], [1, 999]]}, "prompt[1]"),  # the same, for a batch's prompt
        ({"prompt": [1, 2**31]}, "prompt"),  # beyond the wire's int32 token ids
        ({"prompt": [[1, 2], [3, 2**32]]}, "prompt[1]"),
        ({"prompt": ["a"] * 9, "n": 30}, "prompt"),  # 270 choices in all
        (
            {"prompt": "x", "logit_bias": {str(i): 1 for i in range(1025)}},
            "logit_bias",
        ),  # the front door's bound, named as the request's param
    ],
)
def test_bad_fields_are_400_naming_the_param(kwargs: dict[str, Any], param: str) -> None:
    async def scenario() -> None:
        async with control_plane(http_port=0) as cp:
            await cp.add("c0", "colocated")
            with pytest.raises(openai.BadRequestError) as caught:
                await client(cp).completions.create(model=MODEL, **kwargs)
            assert caught.value.status_code == 400 and caught.value.param == param
            assert param in caught.value.message
            await idle(cp)

    asyncio.run(scenario())


@run_async
async def test_chat_errors_unknown_model_and_no_workers() -> None:
    async with control_plane(http_port=0) as cp:
        api = client(cp)
        with pytest.raises(openai.InternalServerError) as unavailable:
            await api.completions.create(model=MODEL, prompt="x")
        assert unavailable.value.status_code == 503
        await cp.add("c0", "colocated")
        with pytest.raises(openai.NotFoundError) as missing:
            await api.completions.create(model="gpt-9", prompt="x")
        assert (missing.value.code, missing.value.param) == ("model_not_found", "model")
        image: Any = [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]
        with pytest.raises(openai.BadRequestError) as bad:
            await api.chat.completions.create(model=MODEL, messages=image)
        assert bad.value.param == "messages[0].content[0]"
        with pytest.raises(openai.BadRequestError) as bad:
            await api.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "x"}], top_logprobs=2
            )
        assert bad.value.param == "top_logprobs"
        with pytest.raises(openai.BadRequestError) as bad:  # not implemented: never ignored
            await api.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "x"}], tool_choice="required"
            )
        assert bad.value.param == "tool_choice"
        with pytest.raises(openai.BadRequestError) as bad:
            await api.completions.create(
                model=MODEL, prompt="x", extra_body={"guided_choice": ["yes", "no"]}
            )
        assert bad.value.param == "guided_choice" and "not supported" in bad.value.message


@run_async
async def test_models_retrieve_answers_the_served_model_and_404s_others() -> None:
    """GET /v1/models/{model}: the served model's object; any other id is 404
    model_not_found in OpenAI's error shape."""
    async with control_plane(http_port=0) as cp:
        await cp.add("c0", "colocated")
        api = client(cp)
        model = await api.models.retrieve(MODEL)
        assert (model.id, model.object, model.owned_by) == (MODEL, "model", "kvmesh")
        with pytest.raises(openai.NotFoundError) as missing:
            await api.models.retrieve("org/gpt-9")
        assert (missing.value.code, missing.value.param) == ("model_not_found", "model")


@run_async
async def test_an_unexpected_exception_is_a_500_in_openai_shape() -> None:
    """An exception no handler expects answers 500 with OpenAI's JSON error body."""
    async with control_plane(http_port=0) as cp:
        await cp.add("c0", "colocated")

        def broken() -> generation_pb2.ModelInfo:
            raise RuntimeError("boom")

        cp.server.front_door.model_info = broken  # type: ignore[method-assign]
        status, content_type, body = await asyncio.to_thread(get, cp, "/v1/models")
        assert (status, content_type) == (500, "application/json")
        assert json.loads(body)["error"]["type"] == "server_error"
        assert "boom" not in body


@run_async
async def test_a_refused_max_completion_tokens_is_named_as_sent() -> None:
    """Chat's max_completion_tokens refused (here by the front door's bound) is the error's
    param, not the max_tokens it travels as."""
    async with control_plane(http_port=0) as cp:
        await cp.add("c0", "colocated")
        with pytest.raises(openai.BadRequestError) as caught:
            await client(cp).chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "x"}],
                max_completion_tokens=2**21,
            )  # fmt: skip
        assert caught.value.param == "max_completion_tokens"
        assert "400 - max_completion_tokens: must be in" in caught.value.message
        await idle(cp)


@run_async
async def test_admission_full_is_429_with_retry_after() -> None:
    async with control_plane(http_port=0, max_inflight=1, retry_after_ms=1500) as cp:
        worker = await cp.add("c0", "colocated")
        worker.gate = asyncio.Event()
        api = client(cp)
        first = asyncio.create_task(api.completions.create(model=MODEL, prompt="x"))
        await asyncio.wait_for(worker.stream_started.wait(), 5)
        with pytest.raises(openai.RateLimitError) as caught:
            await api.completions.create(model=MODEL, prompt="y")
        assert caught.value.response.headers["retry-after"] == "2"
        worker.gate.set()
        assert (await first).choices[0].text == "abbb"
        await idle(cp)


@run_async
async def test_a_batch_of_prompts_answers_each_in_order_streamed_or_not() -> None:
    async with control_plane(http_port=0) as cp:
        await cp.add("p0", "prefill"), await cp.add("d0", "decode")
        api = client(cp)
        prompts: Any = ["hi", "there you", "x"]  # one token per character here: 12 in all
        done = await api.completions.create(model=MODEL, prompt=prompts, max_tokens=4)
        assert [(c.index, c.text, c.finish_reason) for c in done.choices] == [
            (i, "abbb", "length") for i in range(3)
        ]
        assert done.usage is not None
        assert (done.usage.prompt_tokens, done.usage.completion_tokens) == (12, 12)
        stream = await api.completions.create(
            model=MODEL,
            prompt=[[5, 6, 7], [8]],
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = [chunk async for chunk in stream]
        texts: dict[int, str] = {}
        for chunk in chunks:
            for choice in chunk.choices:
                texts[choice.index] = texts.get(choice.index, "") + choice.text
        assert texts == {0: "abbb", 1: "abbb"} and len({c.id for c in chunks}) == 1
        usage = chunks[-1].usage
        assert usage is not None and (usage.prompt_tokens, usage.completion_tokens) == (4, 8)
        await idle(cp)


@run_async
async def test_client_leaving_a_batch_mid_stream_releases_every_block() -> None:
    async with control_plane(http_port=0) as cp:
        await cp.add("p0", "prefill")
        decode = await cp.add("d0", "decode")
        decode.after_first_gate = asyncio.Event()  # every stream stalls after its first token
        stream = await client(cp).completions.create(
            model=MODEL, prompt=["a", "b", "c"], stream=True
        )
        firsts = [await stream.__anext__() for _ in range(3)]
        assert sorted(c.choices[0].index for c in firsts) == [0, 1, 2]
        assert len(decode.held) == 3
        await stream.close()
        await idle(cp)
        ledger = cp.server.cluster.ledger
        assert [ledger.closed_outcome(f"{firsts[0].id}-{i}") for i in range(3)] == ["CANCELLED"] * 3


@run_async
async def test_client_leaving_mid_stream_releases_every_block() -> None:
    async with control_plane(http_port=0) as cp:
        await cp.add("p0", "prefill")
        decode = await cp.add("d0", "decode")
        decode.after_first_gate = asyncio.Event()  # the stream stalls after its first token
        stream = await client(cp).completions.create(model=MODEL, prompt="hi", stream=True)
        first = await stream.__anext__()
        assert first.choices[0].text == "a" and decode.held
        await stream.close()
        await idle(cp)
        assert cp.server.cluster.ledger.closed_outcome(first.id) == "CANCELLED"


@pytest.mark.parametrize("stream", [False, True])
def test_client_timing_out_before_the_first_token_releases_every_block(stream: bool) -> None:
    async def scenario() -> None:
        async with control_plane(http_port=0) as cp:
            await cp.add("p0", "prefill")
            decode = await cp.add("d0", "decode")
            decode.gate = asyncio.Event()  # no token ever comes
            with pytest.raises(openai.APITimeoutError):
                await client(cp, timeout=0.5).completions.create(
                    model=MODEL, prompt="x", stream=stream
                )
            await idle(cp)
            assert decode.released

    asyncio.run(scenario())


@run_async
async def test_drain_refuses_new_requests_and_stops_the_http_server() -> None:
    async with control_plane(http_port=0) as cp:
        await cp.add("c0", "colocated")
        assert cp.server.http is not None
        url = cp.server.http.url
        cp.server.front_door.draining = True
        assert (await asyncio.to_thread(get, cp, "/health"))[0] == 503
        with pytest.raises(openai.InternalServerError):
            await client(cp).completions.create(model=MODEL, prompt="x")
        await asyncio.wait_for(cp.server.drain(grace=1.0), 6)
        with pytest.raises(urllib.error.URLError):
            await asyncio.to_thread(urllib.request.urlopen, f"{url}/health", timeout=2)


def test_a_batch_stream_that_never_sent_a_byte_closes_every_run() -> None:
    """The client is gone before the response's first byte (its first send fails): the
    events and the merged responses never started, and every prompt's run is closed anyway
    (a run's close is what releases its blocks)."""
    closed: list[int] = []

    async def run(i: int) -> AsyncIterator[generation_pb2.GenerateResponse]:
        try:
            for _ in range(100):
                yield generation_pb2.GenerateResponse(index=0, text="x")
                await asyncio.sleep(0)
        finally:
            closed.append(i)

    async def events(responses: AsyncIterator[Any]) -> AsyncIterator[str]:
        async for _ in responses:
            yield "data"

    async def receive() -> dict[str, str]:
        return {"type": "http.disconnect"}

    async def send(message: Any) -> None:
        raise OSError("the client is gone")

    async def scenario() -> None:
        runs = [numbered(run(i), i, i) for i in range(3)]
        await first_responses(runs)
        responses = merged(runs)
        deadline = asyncio.get_running_loop().time() + 60
        stream = RunStream(events(responses), responses, runs, deadline)
        with contextlib.suppress(Exception):  # the failed send, however the server wraps it
            await stream({"type": "http", "asgi": {"spec_version": "2.4"}}, receive, send)
        assert sorted(closed) == [0, 1, 2]

    asyncio.run(scenario())


@run_async
async def test_a_batch_larger_than_the_inflight_bound_is_refused_before_any_run() -> None:
    async with control_plane(http_port=0, max_inflight=2) as cp:
        await cp.add("c0", "colocated")
        with pytest.raises(openai.BadRequestError) as caught:
            await client(cp).completions.create(model=MODEL, prompt=["a", "b", "c"])
        assert caught.value.param == "prompt" and "3 prompts" in caught.value.message
        done = await client(cp).completions.create(model=MODEL, prompt=["a", "b"], max_tokens=2)
        assert len(done.choices) == 2
        await idle(cp)


@run_async
async def test_a_batch_that_does_not_fit_beside_the_runs_in_flight_is_429_with_nothing_started(
) -> None:  # fmt: skip
    async with control_plane(http_port=0, max_inflight=2, retry_after_ms=1500) as cp:
        worker = await cp.add("c0", "colocated")
        worker.gate = asyncio.Event()
        api = client(cp)
        first = asyncio.create_task(api.completions.create(model=MODEL, prompt="x"))
        await asyncio.wait_for(worker.stream_started.wait(), 5)
        calls = len(worker.calls)
        with pytest.raises(openai.RateLimitError) as caught:
            await api.completions.create(model=MODEL, prompt=["a", "b"])
        assert caught.value.response.headers["retry-after"] == "2"  # the door's retry delay
        assert len(worker.calls) == calls  # no prompt of the batch reached a worker
        worker.gate.set()
        assert (await first).choices[0].text == "abbb"
        await idle(cp)


@run_async
async def test_a_worker_dying_mid_batch_ends_the_stream_and_releases_every_run() -> None:
    """Every prompt streamed its first token from the one decode worker, which then dies: the
    stream ends with an error event naming a prompt, and every prompt's run is released."""
    async with control_plane(http_port=0) as cp:
        await cp.add("p0", "prefill")
        decode = await cp.add("d0", "decode")
        decode.after_first_gate = asyncio.Event()  # every stream stalls after its first token
        stream = await client(cp).completions.create(model=MODEL, prompt=["a", "b", "c"],
                                                     stream=True)  # fmt: skip
        firsts = [await stream.__anext__() for _ in range(3)]
        assert sorted(c.choices[0].index for c in firsts) == [0, 1, 2]
        await decode.kill()
        with pytest.raises(openai.APIError) as caught:
            async for _ in stream:
                pass
        assert caught.value.message.startswith("prompt[") and "d0" in caught.value.message
        ledger = cp.server.cluster.ledger
        await asyncio.sleep(0.2)
        assert len(ledger) == 0
        assert await cp.server.front_door.wait_idle(2.0)


async def answered_once(
    cp: Harness, worker: FakeWorker, ended: Callable[[], Awaitable[None]]
) -> openai.APIStatusError:
    """The error the official client (its default retries on) raises for a completion whose
    run `ended` (awaited once the worker streams, its tokens held back until then), after
    checking that it ran only once: a retry would have been answered (200)."""
    assert cp.server.http is not None and worker.gate is not None
    api = openai.AsyncOpenAI(base_url=f"{cp.server.http.url}/v1", api_key="unused")
    call = asyncio.create_task(api.completions.create(model=MODEL, prompt="x"))
    await asyncio.wait_for(worker.stream_started.wait(), 5)
    await ended()
    worker.gate.set()  # a retry runs to its end now
    with pytest.raises(openai.APIStatusError) as caught:
        await asyncio.wait_for(call, 10)
    await asyncio.sleep(0.2)
    assert worker.calls.count("Generate") == 1, "the client ran the request again"
    assert caught.value.response.headers["x-should-retry"] == "false"
    return caught.value


@run_async
async def test_an_aborted_request_is_answered_not_to_be_retried() -> None:
    """An owner's Abort is a 409, which the openai client retries by default: the answer says
    `x-should-retry: false`, so the aborted request is not run again."""
    async with control_plane(http_port=0) as cp:
        worker = await cp.add("c0", "colocated")
        worker.gate = asyncio.Event()  # no token until set

        async def abort() -> None:
            [request_id] = list(cp.server.front_door._runs)
            abort = generation_pb2.AbortRequest(request_id=request_id)
            assert (await cp.generation.Abort(abort, timeout=5)).aborted

        error = await answered_once(cp, worker, abort)
        assert (error.status_code, error.code) == (409, "aborted")
        assert await cp.server.front_door.wait_idle(1.0)


@run_async
async def test_a_request_past_max_request_seconds_is_answered_not_to_be_retried() -> None:
    """A request that used up --max-request-seconds is a 504, which the openai client retries
    by default (each retry using it up again): the answer says `x-should-retry: false`."""
    async with control_plane(http_port=0, max_request_seconds=0.5) as cp:
        worker = await cp.add("c0", "colocated")
        worker.gate = asyncio.Event()  # no token in time

        async def past_deadline() -> None:
            while cp.server.front_door.inflight:  # the run ends by its deadline
                await asyncio.sleep(0.01)

        error = await answered_once(cp, worker, past_deadline)
        assert (error.status_code, error.code) == (504, "deadline_exceeded")
        assert await cp.server.front_door.wait_idle(1.0)


@run_async
async def test_a_batch_refused_for_capacity_is_counted_resource_exhausted() -> None:
    """A batch that does not fit beside the runs in flight (429) is counted in
    kvmesh_control_requests_total under its gRPC status, as the gRPC door counts it."""
    async with control_plane(http_port=0, max_inflight=2) as cp:
        worker = await cp.add("c0", "colocated")
        worker.gate = asyncio.Event()
        api = client(cp)
        first = asyncio.create_task(api.completions.create(model=MODEL, prompt="x"))
        await asyncio.wait_for(worker.stream_started.wait(), 5)
        with pytest.raises(openai.RateLimitError):
            await api.completions.create(model=MODEL, prompt=["a", "b"])
        worker.gate.set()
        await first
        registry = cp.server.cluster.metrics.registry

        def counted(status: str) -> float | None:
            labels = {"status": status}
            return registry.get_sample_value("kvmesh_control_requests_total", labels)

        assert (counted("RESOURCE_EXHAUSTED"), counted("UNKNOWN")) == (1.0, None)
        await idle(cp)


@run_async
async def test_a_negative_seed_is_accepted_and_folded_into_the_workers_range() -> None:
    """OpenAI and vLLM take any int64 seed: a negative one reaches the workers as its low 63
    bits (in the engine's [0, 2**63)), the same for the same seed, so its draws repeat."""
    from kvmesh.service.convert import sampling_from_proto

    async with control_plane(http_port=0) as cp:
        await cp.add("p0", "prefill")
        decode = await cp.add("d0", "decode")
        api = client(cp)
        seeds = []
        for seed in (-1, -1, -(2**63), 2**63 - 1):
            done = await api.completions.create(model=MODEL, prompt="hi", max_tokens=2,
                                                seed=seed)  # fmt: skip
            sampling = decode.reserved[done.id].sampling
            assert sampling_from_proto(sampling).seed == sampling.seed  # the engine takes it
            seeds.append(sampling.seed)
        assert seeds == [2**63 - 1, 2**63 - 1, 0, 2**63 - 1]
        await idle(cp)


def test_a_batch_holds_its_runs_back_while_its_reader_does_not_read() -> None:
    """`merged` (a streamed batch's responses) keeps at most RELAY_BUFFER responses waiting,
    each run's pump waiting for room, as a single run's relay does; a reader that leaves while
    every pump waits closes every run at once."""
    produced: list[int] = [0, 0, 0]
    closed: list[int] = []

    async def run(i: int) -> AsyncIterator[generation_pb2.GenerateResponse]:
        try:
            for _ in range(10_000):
                produced[i] += 1
                yield generation_pb2.GenerateResponse(index=0, text="x")
        finally:
            closed.append(i)

    async def scenario() -> None:
        runs = [numbered(run(i), i, i) for i in range(3)]
        responses = merged(runs)
        await anext(responses)
        for _ in range(50):  # the pumps run as far as they may
            await asyncio.sleep(0)
        assert sum(produced) <= RELAY_BUFFER + 2 * len(runs), produced
        await asyncio.wait_for(responses.aclose(), 1)
        assert sorted(closed) == [0, 1, 2]
        assert not [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]

    asyncio.run(scenario())
