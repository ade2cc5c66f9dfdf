"""Bad bodies at the HTTP door of a real control plane: too large (413, before it is read),
not UTF-8, unpaired surrogates, nesting too deep, and 429 with Retry-After when full."""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request

import pytest
from cp_harness import Harness, control_plane, run_async, text_request


def lower(headers: object) -> dict[str, str]:
    return {k.lower(): v for k, v in headers.items()}  # type: ignore[attr-defined]


def post(cp: Harness, body: bytes, path: str = "/v1/completions") -> tuple[int, dict, dict]:  # type: ignore[type-arg]
    """(status, headers, JSON body) of a POST (blocking; run it in a thread)."""
    assert cp.server.http is not None
    request = urllib.request.Request(
        f"{cp.server.http.url}{path}", data=body, headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            return response.status, lower(response.headers), json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, lower(error.headers), json.loads(error.read())


async def answer(cp: Harness, body: bytes, path: str = "/v1/completions") -> tuple[int, dict]:  # type: ignore[type-arg]
    status, _, payload = await asyncio.to_thread(post, cp, body, path)
    return status, payload["error"] if status >= 400 else payload


HUGE = b"0" * 400  # appended to a 1: an integer beyond a float's range


@pytest.mark.parametrize(
    ("body", "status", "param", "text"),
    [
        (b'{"prompt": "' + b"x" * 5000 + b'"}', 413, None, "larger than 4096 bytes"),
        (b'{"prompt": "\xff\xfe"}', 400, None, "not valid JSON"),
        (b'{"prompt": "a\\ud800b"}', 400, "prompt", "not valid Unicode"),
        (b'{"prompt": "a", "stop": ["\\udfff"]}', 400, "stop", "not valid Unicode"),
        (b"[" * 100_000, 413, None, "larger than"),  # beyond the body limit first
        (b'{"prompt": "hi", "n": 1000}', 400, "n", "n"),
        # an integer beyond a float's range for a float param: 400, not a 500
        (
            b'{"prompt": "hi", "repetition_penalty": 1' + HUGE + b"}",
            400,
            "repetition_penalty",
            "range",
        ),
    ],
)
def test_bad_bodies_are_refused_naming_the_param(
    body: bytes, status: int, param: str | None, text: str
) -> None:
    async def scenario() -> None:
        async with control_plane(http_port=0, max_http_body_bytes=4096) as cp:
            prefill = await cp.add("p0", "prefill")
            await cp.add("d0", "decode")
            got, error = await answer(cp, body)
            assert got == status, error
            assert text in error["message"] and error["param"] == param
            assert prefill.calls == []
            counted = {"INVALID_ARGUMENT": 400, "RESOURCE_EXHAUSTED": 413}
            requests = cp.server.cluster.metrics.requests
            assert {c: requests.labels(c)._value.get() for c in counted} == {
                c: float(code == status) for c, code in counted.items()
            }, "a refused request is counted once, under its gRPC code"

    run_async(scenario)()


@run_async
async def test_deep_nesting_within_the_limit_is_400() -> None:
    async with control_plane(http_port=0) as cp:
        await cp.add("c0", "colocated")
        got, error = await answer(cp, b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}")
        assert got == 400 and "nested too deeply" in error["message"]
        got, payload = await answer(cp, json.dumps({"prompt": "x" * 100_000}).encode())
        assert got == 200 and payload["choices"][0]["text"]  # a large body decoded in a thread


@run_async
async def test_full_admission_is_429_with_retry_after() -> None:
    async with control_plane(http_port=0, max_inflight=1, retry_after_ms=1500) as cp:
        await cp.add("p0", "prefill")
        decode = await cp.add("d0", "decode")
        decode.gate = asyncio.Event()
        holder = cp.generation.Generate(text_request(request_id="holder"), timeout=10)
        await asyncio.wait_for(decode.stream_started.wait(), 5)
        status, headers, payload = await asyncio.to_thread(post, cp, b'{"prompt": "hi"}')
        assert status == 429 and headers["retry-after"] == "2"
        assert payload["error"]["type"] == "rate_limit_error"
        decode.gate.set()
        async for _ in holder:
            pass


def peak_rss_mib() -> int:
    """This process's peak resident memory since the last `reset_peak_rss` (MiB)."""
    with open("/proc/self/status") as status:
        line = next(line for line in status if line.startswith("VmHWM"))
    return int(line.split()[1]) // 1024


def reset_peak_rss() -> None:
    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")  # resets VmHWM to the current RSS


@run_async
async def test_a_batch_does_not_copy_an_oversized_sampling_per_prompt() -> None:
    """256 prompts with 400,000 stop token ids (an 800 KB body): refused by the front door's
    bound before each prompt gets its own copy of the list, which took 400 MiB (a 4 MiB body
    with a logit_bias map, 6 GiB) and was refused once per prompt."""
    async with control_plane(http_port=0) as cp:
        prefill = await cp.add("p0", "prefill")
        await cp.add("d0", "decode")
        body = json.dumps(
            {"prompt": [[1]] * 256, "stop_token_ids": [0] * 400_000}, separators=(",", ":")
        ).encode()
        reset_peak_rss()
        before = peak_rss_mib()
        got, error = await answer(cp, body)
        grown = peak_rss_mib() - before
        assert grown < 150, f"the refusal took {grown} MiB"
        assert got == 400 and error["param"] == "stop_token_ids", error
        assert error["message"].startswith("sampling.stop_token_ids: 400000 ids; at most 1024")
        assert prefill.calls == []
        requests = cp.server.cluster.metrics.requests
        assert requests.labels("INVALID_ARGUMENT")._value.get() == 1.0, "refused once"


@run_async
async def test_detokenize_bounds_the_ids_by_the_context_before_any_worker_call() -> None:
    """More ids than the model's context (a 4 MiB body holds two million) are a 400 naming
    `tokens` from the door itself: no worker is sent them."""
    async with control_plane(http_port=0) as cp:
        prefill = await cp.add("p0", "prefill")
        await cp.add("d0", "decode")
        max_len = cp.server.front_door.model_info().max_model_len
        body = json.dumps({"tokens": [1] * (max_len + 1)}).encode()
        got, error = await answer(cp, body, "/detokenize")
        assert got == 400 and error["param"] == "tokens", error
        assert error["message"].startswith(f"tokens: {max_len + 1} ids; at most {max_len}")
        assert prefill.calls == []
