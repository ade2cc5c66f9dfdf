"""The OpenAI-compatible HTTP door of a real `kvmesh up` on loopback, driven by the official
`openai` client: the same answers as gRPC (completions and chat), streams, logprobs, errors,
n > 1 (colocated), and a client leaving mid-stream frees every block."""

from __future__ import annotations

import urllib.request
from pathlib import Path
from typing import Any

import openai
import pytest
from sys_harness import GREEDY, idle, local_system, openai_client, sample, wait_until

from kvmesh.cli.up import LocalSystem
from kvmesh.client import Client

PROMPT = [5, 9, 2, 44, 17]
IGNORE_EOS = {"ignore_eos": True}  # a kvmesh extension field, sent as extra_body


def get(system: LocalSystem, path: str) -> tuple[int, str]:
    with urllib.request.urlopen(f"{system.http_url}{path}", timeout=5) as response:
        return response.status, response.read().decode()


def test_completion_matches_grpc_and_its_stream(openai_system: LocalSystem) -> None:
    client = openai_client(openai_system)
    model = client.models.list().data[0].id
    assert model == Path(openai_system.model_dir).name
    max_tokens, temperature = GREEDY["max_tokens"], GREEDY["temperature"]
    done = client.completions.create(model=model, prompt=PROMPT, max_tokens=max_tokens,
                                     temperature=temperature, extra_body=IGNORE_EOS)  # fmt: skip
    with Client(openai_system.endpoint) as grpc_client:
        expected = grpc_client.complete(PROMPT, **GREEDY)
    assert done.choices[0].text == expected.text and done.choices[0].finish_reason == "length"
    assert done.usage is not None
    assert (done.usage.prompt_tokens, done.usage.completion_tokens) == (5, max_tokens)
    stream = client.completions.create(model=model, prompt=PROMPT, max_tokens=max_tokens,
                                       temperature=temperature, extra_body=IGNORE_EOS, stream=True,
                                       stream_options={"include_usage": True})  # fmt: skip
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected.text
    assert chunks[-1].usage is not None and chunks[-1].usage.total_tokens == 5 + max_tokens
    wait_until(lambda: idle(openai_system), 5.0, "blocks free after the requests")


def check_continuous_usage(client: openai.OpenAI, prompts: list[list[int]], n: int = 1) -> None:
    """vLLM's `continuous_usage_stats`: every chunk carries its choice's usage so far (the
    prompt's tokens, the tokens streamed), the last usage chunk the whole request's."""
    model = client.models.list().data[0].id
    options = {"include_usage": True, "continuous_usage_stats": True}
    stream = client.completions.create(model=model, prompt=prompts, max_tokens=4, n=n, seed=1,
                                       stream=True, stream_options=options,  # type: ignore[arg-type]
                                       logprobs=1, extra_body=IGNORE_EOS)  # fmt: skip
    chunks = list(stream)
    streamed: dict[int, int] = {}
    for chunk in chunks[:-1]:
        (choice,) = chunk.choices
        assert choice.logprobs is not None and choice.logprobs.tokens  # one entry per token
        streamed[choice.index] = streamed.get(choice.index, 0) + len(choice.logprobs.tokens)
        assert chunk.usage is not None
        prompt = len(prompts[choice.index // n])
        assert (chunk.usage.prompt_tokens, chunk.usage.completion_tokens) == (
            prompt,
            streamed[choice.index],
        )
        assert chunk.usage.total_tokens == prompt + streamed[choice.index]
    final = chunks[-1]
    assert final.choices == [] and final.usage is not None
    assert final.usage.prompt_tokens == sum(len(p) for p in prompts)  # once per prompt, as vLLM
    assert final.usage.completion_tokens == 4 * n * len(prompts) == sum(streamed.values())


def test_continuous_usage_stats_on_every_chunk(openai_system: LocalSystem) -> None:
    check_continuous_usage(openai_client(openai_system), [PROMPT, [7, 3, 11]])
    wait_until(lambda: idle(openai_system), 5.0, "blocks free after the requests")


def test_a_batch_of_prompts_answers_as_the_prompts_one_by_one(openai_system: LocalSystem) -> None:
    client = openai_client(openai_system)
    model = client.models.list().data[0].id
    prompts = [PROMPT, [7, 3, 11, 12], PROMPT[:2]]
    params: dict[str, Any] = {
        "model": model,
        "max_tokens": GREEDY["max_tokens"],
        "temperature": GREEDY["temperature"],
        "extra_body": IGNORE_EOS,
    }
    batch = client.completions.create(prompt=prompts, logprobs=1, **params)
    singles = [
        client.completions.create(prompt=p, logprobs=1, **params).choices[0] for p in prompts
    ]
    assert [c.index for c in batch.choices] == [0, 1, 2]
    assert [c.text for c in batch.choices] == [c.text for c in singles]
    got = [c.logprobs.tokens for c in batch.choices if c.logprobs is not None]
    assert got == [c.logprobs.tokens for c in singles if c.logprobs is not None]
    assert batch.usage is not None and batch.usage.prompt_tokens == 11
    assert batch.usage.completion_tokens == 3 * GREEDY["max_tokens"]
    wait_until(lambda: idle(openai_system), 5.0, "blocks free after the batch")


def hf_prompt_logprobs(model_dir: str, prompt: list[int]) -> list[float]:
    """transformers' log-probability of each prompt token after the first (float32)."""
    import torch
    from transformers import AutoModelForCausalLM

    model: Any = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.inference_mode():
        logits = model(torch.tensor([prompt])).logits[0, :-1].float()  # [L - 1, vocab]
    picked = logits.log_softmax(dim=-1).gather(1, torch.tensor(prompt[1:]).unsqueeze(1))
    return [float(v) for v in picked.squeeze(1)]


def check_echoed_prompt(choice: Any, model_dir: str, prompt: list[int]) -> None:
    """The choice's logprobs start with the prompt's: its tokens, null for the first, then
    transformers' values."""
    lp = choice.logprobs
    assert lp is not None and lp.token_logprobs is not None and lp.top_logprobs is not None
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    expected = hf_prompt_logprobs(model_dir, prompt)
    got = lp.token_logprobs[1 : len(prompt)]
    assert got == pytest.approx(expected, abs=1e-3)
    tokens, tops = lp.tokens or [], lp.top_logprobs[1 : len(prompt)]
    for token, logprob, top in zip(tokens[1 : len(prompt)], got, tops, strict=True):
        assert 1 <= len(top) <= 2 and top[token] == logprob  # the most likely and the token


def test_echo_returns_the_prompt_with_its_logprobs(openai_system: LocalSystem) -> None:
    """lm-eval's loglikelihood request (echo, max_tokens 0, logprobs) and echo before a
    completion, disaggregated: the prefill worker scores the prompt."""
    from transformers import AutoTokenizer

    client = openai_client(openai_system)
    model = client.models.list().data[0].id
    only = client.completions.create(model=model, prompt=PROMPT, echo=True, max_tokens=0,
                                     logprobs=1, temperature=0)  # fmt: skip
    (choice,) = only.choices
    tokenizer = AutoTokenizer.from_pretrained(openai_system.model_dir)
    assert choice.text == tokenizer.decode(PROMPT, skip_special_tokens=False)
    assert choice.finish_reason == "length" and choice.logprobs is not None
    assert len(choice.logprobs.token_logprobs or []) == len(PROMPT)
    check_echoed_prompt(choice, openai_system.model_dir, PROMPT)
    assert only.usage is not None and only.usage.completion_tokens == 0
    params: dict[str, Any] = {"model": model, "max_tokens": 4, "temperature": 0,
                              "extra_body": IGNORE_EOS}  # fmt: skip
    plain = client.completions.create(prompt="The KV", **params).choices[0].text
    echoed = client.completions.create(prompt="The KV", echo=True, **params).choices[0]
    assert echoed.text == "The KV" + plain
    streamed = client.completions.create(prompt=PROMPT, echo=True, logprobs=1, stream=True,
                                         **params)  # fmt: skip
    chunks = [c.choices[0] for c in streamed if c.choices]
    assert "".join(c.text for c in chunks).startswith(choice.text)
    first = chunks[0].logprobs
    assert first is not None and first.token_logprobs is not None
    assert first.token_logprobs[0] is None and len(first.token_logprobs) == len(PROMPT) + 1
    extra = {**IGNORE_EOS, "prompt_logprobs": 2}  # vLLM's field
    scored = client.completions.create(model=model, prompt=PROMPT, max_tokens=2, extra_body=extra)
    vllm_shape = (scored.choices[0].model_extra or {})["prompt_logprobs"]
    assert vllm_shape[0] is None and len(vllm_shape) == len(PROMPT)
    expected = hf_prompt_logprobs(openai_system.model_dir, PROMPT)
    for position, entry in enumerate(vllm_shape[1:], start=1):
        mine = entry[str(PROMPT[position])]
        assert mine["logprob"] == pytest.approx(expected[position - 1], abs=1e-3)
        assert mine["rank"] >= 1 and 2 <= len(entry) <= 3
    chat = client.chat.completions.create(model=model, max_tokens=2, extra_body=extra,
                                          messages=[{"role": "user", "content": "hi"}])  # fmt: skip
    chat_shape = (chat.model_extra or {})["prompt_logprobs"]
    assert chat_shape[0] is None and all(entry for entry in chat_shape[1:])
    # the same over gRPC, with the Python client
    with Client(openai_system.endpoint) as grpc_client:
        result = grpc_client.complete(PROMPT, prompt_logprobs=1, logprobs=1, **GREEDY)
    prompt_lp = result.prompt_logprobs
    assert result.prompt_text == tokenizer.decode(PROMPT, skip_special_tokens=False)
    assert [lp.token_id for lp in prompt_lp] == PROMPT and prompt_lp[0].logprob is None
    assert [lp.logprob for lp in prompt_lp[1:]] == pytest.approx(expected, abs=1e-3)
    assert all(lp.rank >= 1 and len(lp.top) == 1 for lp in prompt_lp[1:])
    (completion,) = result.completions
    assert [lp.token_id for lp in completion.logprobs] == completion.token_ids
    wait_until(lambda: idle(openai_system), 5.0, "blocks free after the echoes")


def test_chat_matches_grpc_chat_with_token_logprobs(openai_system: LocalSystem) -> None:
    client = openai_client(openai_system)
    model = client.models.list().data[0].id
    messages: Any = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    with Client(openai_system.endpoint) as grpc_client:
        expected = grpc_client.complete_chat(messages, **GREEDY)
    done = client.chat.completions.create(
        model=model, messages=messages, max_completion_tokens=GREEDY["max_tokens"],
        temperature=0, logprobs=True, top_logprobs=2, extra_body=IGNORE_EOS,
    )  # fmt: skip
    choice = done.choices[0]
    assert (choice.message.role, choice.message.content) == ("assistant", expected.text)
    assert done.usage is not None
    expected_usage = expected.completions[0].usage
    assert expected_usage is not None and done.usage.prompt_tokens == expected_usage.prompt_tokens
    assert choice.logprobs is not None and choice.logprobs.content is not None
    content = choice.logprobs.content
    assert len(content) == GREEDY["max_tokens"]
    for item, token_id in zip(content, expected.completions[0].token_ids, strict=True):
        # the tiny tokenizer's ids 0-255 are one byte each (alone, most are no character)
        own = [token_id] if token_id < 256 else list(item.token.encode())
        assert item.bytes == own and len(item.top_logprobs) == 2
    stream = client.chat.completions.create(model=model, messages=messages, temperature=0,
                                            max_completion_tokens=GREEDY["max_tokens"],
                                            extra_body=IGNORE_EOS, stream=True)  # fmt: skip
    assert "".join(c.choices[0].delta.content or "" for c in stream) == expected.text


def test_chat_logprob_bytes_are_the_tokens_own_bytes(openai_system: LocalSystem) -> None:
    """A token that is part of a UTF-8 character reads as U+FFFD alone; its `bytes` are its
    own (0xC8 here, forced by logit_bias), not U+FFFD's, and the alternatives' too."""
    client = openai_client(openai_system)
    model = client.models.list().data[0].id
    done = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Hi"}], max_completion_tokens=3,
        temperature=0, logprobs=True, top_logprobs=3, logit_bias={"200": 100},
        extra_body=IGNORE_EOS,
    )  # fmt: skip
    logprobs = done.choices[0].logprobs
    assert logprobs is not None and logprobs.content is not None
    for item in logprobs.content:
        assert (item.token, item.bytes) == ("\ufffd", [0xC8])
        for alternative in item.top_logprobs:  # a byte token, or another as its text
            raw = bytes(alternative.bytes)
            assert len(raw) == 1 or raw == alternative.token.encode()


def test_logprobs_errors_health_and_metrics(openai_system: LocalSystem) -> None:
    client = openai_client(openai_system)
    model = client.models.list().data[0].id
    done = client.completions.create(model=model, prompt="The KV", max_tokens=4, logprobs=2,
                                     temperature=0, extra_body=IGNORE_EOS)  # fmt: skip
    logprobs = done.choices[0].logprobs
    assert logprobs is not None and logprobs.tokens is not None and len(logprobs.tokens) == 4
    assert all(lp <= 0 for lp in logprobs.token_logprobs or [])
    tops = logprobs.top_logprobs or []
    assert len(tops) == 4 and all(len(top) == 2 for top in tops)
    values = logprobs.token_logprobs or []
    for token, logprob, top in zip(logprobs.tokens, values, tops, strict=True):
        assert top[token] == logprob == max(top.values())  # greedy: the most likely
    drawn = client.completions.create(
        model=model, prompt="The KV", max_tokens=4, logprobs=0, seed=5, extra_body=IGNORE_EOS
    )
    lp = drawn.choices[0].logprobs  # a sampled token's top_logprobs hold it (logprobs + 1)
    assert lp is not None and lp.tokens is not None and lp.top_logprobs is not None
    values = lp.token_logprobs or []
    assert lp.top_logprobs == [{t: v} for t, v in zip(lp.tokens, values, strict=True)]
    with pytest.raises(openai.BadRequestError) as caught:  # the worker's vocabulary check
        client.completions.create(model=model, prompt=[1, 10**6])
    assert caught.value.param == "prompt"
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=model, prompt="x", top_p=0)
    assert caught.value.param == "top_p"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="not-" + model, prompt="x")
    assert get(openai_system, "/health")[0] == 200
    status, text = get(openai_system, "/metrics")
    assert status == 200 and 'kvmesh_control_requests_total{status="OK"}' in text


def test_logit_bias_steers_greedy_tokens_over_http_and_grpc(openai_system: LocalSystem) -> None:
    """+100 forces a token at every step, -100 bans the greedy choice; the HTTP door gives
    gRPC's answer; a token id outside the vocabulary is the worker's 400 naming the param."""
    client = openai_client(openai_system)
    model = client.models.list().data[0].id
    with Client(openai_system.endpoint) as grpc_client:
        first = grpc_client.complete(PROMPT, **GREEDY).token_ids[0]
        forced = grpc_client.complete(PROMPT, logit_bias={7: 100.0}, **GREEDY)
        banned = grpc_client.complete(PROMPT, logit_bias={first: -100.0}, **GREEDY)
    assert forced.token_ids == [7] * GREEDY["max_tokens"]
    assert first not in banned.token_ids
    done = client.completions.create(model=model, prompt=PROMPT, max_tokens=GREEDY["max_tokens"],
                                     temperature=0, logit_bias={"7": 100},
                                     extra_body=IGNORE_EOS)  # fmt: skip
    assert done.choices[0].text == forced.text
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=model, prompt="x", logit_bias={str(10**6): 1})
    assert caught.value.param == "logit_bias"
    wait_until(lambda: idle(openai_system), 5.0, "blocks free after the requests")


def test_stop_reason_and_the_stop_tokens_text_as_vllm_answers(openai_system: LocalSystem) -> None:
    """Every choice carries vLLM's `stop_reason` (the stop token id or stop string; null for
    EOS or a length), streamed (on the last chunk) or not; the token that stopped a choice (a
    stop token id, EOS with special tokens kept) leaves its text out unless
    include_stop_str_in_output, even as the first token (sampled by the prefill worker)."""
    client = openai_client(openai_system)
    model = client.models.list().data[0].id
    x, eos = ord("x"), 257  # the byte tokenizer's "x" and <eos>
    included = {"stop_token_ids": [x], "include_stop_str_in_output": True}
    cases: list[tuple[dict[str, Any], str, object]] = [
        ({"logit_bias": {str(x): 100}, "extra_body": {"stop_token_ids": [x]}}, "", x),
        ({"logit_bias": {str(eos): 100}, "extra_body": {"skip_special_tokens": False}}, "", None),
        ({"logit_bias": {str(x): 100}, "extra_body": included}, "x", x),
        ({"logit_bias": {str(x): 100}, "stop": ["xx"]}, "", "xx"),
        ({"logit_bias": {str(x): 100}, "extra_body": IGNORE_EOS}, "xxxx", None),
    ]
    for params, text, stop_reason in cases:
        params = {"model": model, "prompt": PROMPT, "max_tokens": 4, "temperature": 0, **params}
        done = client.completions.create(**params).choices[0]
        chunks = [c.choices[0] for c in client.completions.create(stream=True, **params)]
        assert done.text == "".join(c.text for c in chunks) == text, params
        assert (done.model_extra or {})["stop_reason"] == stop_reason, params
        assert (chunks[-1].model_extra or {})["stop_reason"] == stop_reason, params
        assert done.finish_reason == chunks[-1].finish_reason
        assert done.finish_reason == ("length" if text == "xxxx" else "stop")
    chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "a"}],
                                          max_tokens=4, temperature=0, stop=["xx"],
                                          logit_bias={str(x): 100})  # fmt: skip
    assert chat.choices[0].message.content == "" and chat.choices[0].finish_reason == "stop"
    assert (chat.choices[0].model_extra or {})["stop_reason"] == "xx"
    wait_until(lambda: idle(openai_system), 5.0, "blocks free after the requests")


# vLLM fields that change the answer (a chat template's variables, decoding limits, more in the
# body) which this server does not implement, as the openai client sends them: (endpoint, the
# call's params, the param the 400 names). Each used to answer 200 as if it were absent.
UNHONOURED: list[tuple[str, dict[str, Any], str]] = [
    # vLLM constrains the completion to JSON; the tiny model's text is not JSON
    ("completion", {"extra_body": {"response_format": {"type": "json_object"}}}, "response_format"),
    ("completion", {"extra_body": {"prompt_embeds": "AAAA"}}, "prompt_embeds"),  # the prompt
    ("chat", {"reasoning_effort": "none"}, "reasoning_effort"),  # the template's enable_thinking
    ("chat", {"extra_body": {"chat_template": "{{ 'x' }}"}}, "chat_template"),  # not trusted
    ("chat", {"extra_body": {"thinking_token_budget": 4}}, "thinking_token_budget"),
    ("completion", {"extra_body": {"repetition_detection": {"max_pattern_size": 2,
                                                           "min_count": 2}}},
     "repetition_detection"),
    ("chat", {"logprobs": True, "extra_body": {"logprob_token_ids": [7]}}, "logprob_token_ids"),
    ("completion", {"extra_body": {"logits_processors": ["pkg.mod:Proc"]}}, "logits_processors"),
    ("completion", {"extra_body": {"return_token_ids": True}}, "return_token_ids"),
    ("chat", {"extra_body": {"return_prompt_text": True}}, "return_prompt_text"),
    ("chat", {"messages": [{"role": "user", "content": "a"},
                           {"role": "assistant", "content": "b", "reasoning": "c"},
                           {"role": "user", "content": "d"}]}, "messages[1].reasoning"),
]  # fmt: skip


@pytest.mark.parametrize(("kind", "params", "param"), UNHONOURED)
def test_vllm_fields_that_change_the_answer_are_refused_not_ignored(
    openai_system: LocalSystem, kind: str, params: dict[str, Any], param: str
) -> None:
    """A user switching from vLLM never gets an answer that silently lacks what a field asked
    for: each is a 400 naming it (no run starts)."""
    client = openai_client(openai_system)
    model = client.models.list().data[0].id
    with pytest.raises(openai.BadRequestError) as caught:
        if kind == "completion":
            client.completions.create(model=model, prompt="x", max_tokens=4, **params)
        else:
            params = {"messages": [{"role": "user", "content": "a"}], **params}
            client.chat.completions.create(model=model, max_tokens=4, **params)
    assert caught.value.param == param


def test_top_logprobs_zero_without_logprobs_is_accepted_as_vllm_accepts_it(
    openai_system: LocalSystem,
) -> None:
    """`top_logprobs: 0` asks for nothing (vLLM needs `logprobs` only for more): no logprobs."""
    client = openai_client(openai_system)
    model = client.models.list().data[0].id
    done = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "a"}],
                                          max_tokens=2, top_logprobs=0)  # fmt: skip
    assert done.choices[0].logprobs is None


def test_client_leaving_mid_stream_frees_every_block(openai_system: LocalSystem) -> None:
    client = openai_client(openai_system)
    model = client.models.list().data[0].id
    metrics = openai_system.control_metrics
    cancelled = sample(metrics, "kvmesh_control_requests_total", status="CANCELLED")
    stream = client.completions.create(model=model, prompt=PROMPT, max_tokens=1500,
                                       extra_body=IGNORE_EOS, stream=True)  # fmt: skip
    next(iter(stream))
    stream.close()
    wait_until(lambda: idle(openai_system), 5.0, "blocks free after the client left")
    assert sample(metrics, "kvmesh_control_requests_total", status="CANCELLED") == cancelled + 1


def test_n_completions_colocated_then_503_without_workers(tiny_model: str) -> None:
    with local_system(model=tiny_model, http_port=0, prefill=0, decode=0, colocated=1) as (
        system, _,
    ):  # fmt: skip
        client = openai_client(system)
        model = client.models.list().data[0].id
        done = client.completions.create(model=model, prompt="Hello", n=2, max_tokens=6, seed=1,
                                         extra_body=IGNORE_EOS)  # fmt: skip
        assert sorted(c.index for c in done.choices) == [0, 1]
        assert done.usage is not None and done.usage.completion_tokens == 12
        echoed = client.completions.create(model=model, prompt=PROMPT, echo=True, max_tokens=2,
                                           n=2, logprobs=1, seed=1)  # fmt: skip
        for choice in echoed.choices:  # the colocated worker scores the prompt itself
            check_echoed_prompt(choice, tiny_model, PROMPT)
        check_continuous_usage(client, [PROMPT, [7, 3, 11]], n=2)
        system.supervisor.stop(system.workers[0].child, grace=5.0)
        wait_until(lambda: get_status(system, "/health") == 503, 10.0, "health 503")
        with pytest.raises(openai.InternalServerError) as caught:
            client.completions.create(model=model, prompt="x")
        assert caught.value.status_code == 503


def get_status(system: LocalSystem, path: str) -> int:
    try:
        return get(system, path)[0]
    except urllib.error.HTTPError as error:
        return error.code


def test_completion_with_a_null_max_tokens_generates_the_default_16(
    openai_system: LocalSystem,
) -> None:
    """`max_tokens: null` on completions is the default 16, as vLLM 0.32 answers it (its
    `normalize_null_max_tokens`), not "up to the context"."""
    client = openai_client(openai_system)
    model = client.models.list().data[0].id
    prompt = [5 + i % 200 for i in range(2020)]  # 28 tokens of the 2048 context left
    done = client.completions.create(model=model, prompt=prompt, max_tokens=None,
                                     temperature=0.0, extra_body=IGNORE_EOS)  # fmt: skip
    assert done.usage is not None and done.usage.completion_tokens == 16
    assert done.choices[0].finish_reason == "length"
    wait_until(lambda: idle(openai_system), 5.0, "blocks free after the request")


def test_max_tokens_beyond_the_context_left_is_clamped_as_vllm_does(
    openai_system: LocalSystem,
) -> None:
    """vLLM 0.32 refuses only max_tokens > max_model_len; a max_tokens the prompt leaves no
    room for generates up to the context and finishes with "length" (its `get_max_tokens`)."""
    client = openai_client(openai_system)
    model = client.models.list().data[0].id
    prompt = [5 + i % 200 for i in range(2040)]  # 8 tokens of the 2048 context left
    done = client.completions.create(model=model, prompt=prompt, max_tokens=16,
                                     temperature=0.0, extra_body=IGNORE_EOS)  # fmt: skip
    assert done.usage is not None and done.usage.completion_tokens == 8
    assert done.choices[0].finish_reason == "length"
