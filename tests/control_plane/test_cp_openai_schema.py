"""OpenAI bodies → GenerateRequest, and GenerateResponses → OpenAI objects (no server)."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest

from control_plane.openai_http.errors import ApiError
from control_plane.openai_http.schema import parse
from control_plane.openai_http.stream import Answer, Echo, sse
from kvmesh.v1 import generation_pb2


def test_completion_body_maps_every_sampling_field() -> None:
    body = {
        "model": "m", "prompt": ["hello"], "max_tokens": 5, "temperature": 0, "top_p": 0.5,
        "n": 2, "seed": 3, "presence_penalty": 0.5, "frequency_penalty": -1, "stop": "\n",
        "logprobs": 2, "stream": True, "stream_options": {"include_usage": True},
        "user": "u", "not_an_openai_field": {"ignored": True},
    }  # fmt: skip
    parsed = parse(body, "completion")
    request, s = parsed.request, parsed.request.sampling
    assert request.text == "hello" and not request.request_id
    assert (s.max_tokens, s.temperature, s.top_p, s.n, s.seed) == (5, 0, 0.5, 2, 3)
    assert (s.presence_penalty, s.frequency_penalty, list(s.stop)) == (0.5, -1, ["\n"])
    assert s.logprobs == 2 and parsed.logprobs == 2
    assert (parsed.stream, parsed.include_usage) == (True, True)
    assert (parsed.model, parsed.user) == ("m", "u")
    assert not s.HasField("top_k")  # unset stays unset (engine default)


def test_token_prompts_and_chat_messages() -> None:
    assert list(parse({"prompt": [[4, 5]]}, "completion").request.token_ids.ids) == [4, 5]
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    body = {
        "messages": [
            {"role": "system", "content": "s"},
            {"role": "user", "content": parts, "name": "ann"},
            {"role": "assistant", "content": None},
        ],
        "max_tokens": 9, "max_completion_tokens": 4, "logprobs": True, "top_logprobs": 3,
    }  # fmt: skip
    parsed = parse(body, "chat")
    chat = [(m.role, m.content, m.name) for m in parsed.request.chat.messages]
    assert chat == [("system", "s", ""), ("user", "a\nb", "ann"), ("assistant", "", "")]
    assert parsed.request.sampling.max_tokens == 4  # max_completion_tokens wins
    assert parsed.logprobs == 3 and parsed.request.sampling.logprobs == 3
    assert parse({"messages": body["messages"]}, "chat").logprobs is None


def test_chat_without_a_length_generates_up_to_the_context() -> None:
    """Chat without max_tokens or max_completion_tokens asks for max_tokens -1 (no bound but
    the model's context, OpenAI's chat default); completions keep the workers' 16."""
    messages = [{"role": "user", "content": "x"}]
    assert parse({"messages": messages}, "chat").request.sampling.max_tokens == -1
    assert parse({"messages": messages, "max_tokens": 5}, "chat").request.sampling.max_tokens == 5
    assert not parse({"prompt": "x"}, "completion").request.sampling.HasField("max_tokens")
    # an explicit null is the default 16, as vLLM 0.32 reads it (normalize_null_max_tokens)
    null = parse({"prompt": "x", "max_tokens": None}, "completion")
    assert not null.request.sampling.HasField("max_tokens")
    chat_null = parse({"messages": messages, "max_completion_tokens": None}, "chat")
    assert chat_null.request.sampling.max_tokens == -1


def test_the_length_param_is_the_one_the_body_used() -> None:
    """A refused length is named by the field the body set: max_completion_tokens wins."""
    messages = [{"role": "user", "content": "x"}]
    both = {"messages": messages, "max_tokens": 3, "max_completion_tokens": 4}
    assert parse(both, "chat").max_tokens_param == "max_completion_tokens"
    assert parse({"messages": messages, "max_tokens": 3}, "chat").max_tokens_param == "max_tokens"
    body = {"prompt": "x", "max_completion_tokens": 4}  # not a completions field
    assert parse(body, "completion").max_tokens_param == "max_tokens"


def test_vllm_stop_fields_reach_the_sampling_params() -> None:
    """vLLM's stop_token_ids, include_stop_str_in_output, skip_special_tokens and min_tokens
    (sent by the openai client as extra_body) are kept, not dropped."""
    body = {
        "prompt": "x", "stop_token_ids": [65, 2], "include_stop_str_in_output": True,
        "skip_special_tokens": False, "min_tokens": 3,
    }  # fmt: skip
    s = parse(body, "completion").request.sampling
    assert list(s.stop_token_ids) == [65, 2] and s.min_tokens == 3
    assert s.include_stop_str_in_output and not s.skip_special_tokens
    unset = parse({"prompt": "x"}, "completion").request.sampling
    assert not unset.HasField("include_stop_str_in_output")
    assert not unset.HasField("skip_special_tokens") and not unset.stop_token_ids


def test_logit_bias_becomes_the_proto_map() -> None:
    body = {"prompt": "x", "logit_bias": {"17": -100, "3": 2.5, "0": 100}}
    assert dict(parse(body, "completion").request.sampling.logit_bias) == {17: -100, 3: 2.5, 0: 100}
    assert not parse({"prompt": "x"}, "completion").request.sampling.logit_bias


@pytest.mark.parametrize(
    ("kind", "body", "param"),
    [
        ("completion", [], None),
        ("completion", {}, "prompt"),
        ("completion", {"prompt": ""}, "prompt"),
        ("completion", {"prompt": [1, -2]}, "prompt"),
        ("completion", {"prompt": [1, 2**31]}, "prompt"),  # token ids travel as int32
        ("completion", {"prompt": [[1, 2], [3, 2**32]]}, "prompt[1]"),
        ("completion", {"prompt": "x", "stop_token_ids": [2**31]}, "stop_token_ids"),
        ("completion", {"prompt": "x", "stop_token_ids": 5}, "stop_token_ids"),
        ("completion", {"prompt": "x", "skip_special_tokens": 0}, "skip_special_tokens"),
        ("completion", {"prompt": "x", "top_p": 0}, "top_p"),
        ("completion", {"prompt": "x", "seed": 2**63}, "seed"),  # beyond int64
        ("completion", {"prompt": "x", "max_tokens": 2**40}, "max_tokens"),
        ("completion", {"prompt": "x", "stream": "yes"}, "stream"),
        ("completion", {"prompt": "x", "stream_options": {"include_usage": True}},
         "stream_options"),  # only with stream: true
        ("completion", {"prompt": "x", "stream": True, "stream_options": {"include_usage": 1}},
         "stream_options.include_usage"),  # the nested field, by its path
        ("chat", {"messages": [{"role": "user", "content": "x"}], "stream": True,
                  "stream_options": {"continuous_usage_stats": "yes"}},
         "stream_options.continuous_usage_stats"),
        ("completion", {"prompt": "x", "echo": 1}, "echo"),
        ("completion", {"prompt": "x", "prompt_logprobs": 21}, "prompt_logprobs"),
        ("chat", {"messages": [{"role": "u", "content": "x"}], "prompt_logprobs": -1},
         "prompt_logprobs"),
        ("completion", {"prompt": "x", "max_tokens": 0}, "max_tokens"),  # 0 only with echo
        ("completion", {"prompt": "x", "echo": True, "max_tokens": False}, "max_tokens"),
        ("completion", {"prompt": "x", "best_of": 3}, "best_of"),
        ("completion", {"prompt": "x", "logit_bias": {"1": 101}}, "logit_bias"),
        ("completion", {"prompt": "x", "logit_bias": {"a": 1}}, "logit_bias"),
        ("completion", {"prompt": "x", "logit_bias": {"\u00b2": 1}}, "logit_bias"),  # a digit
        ("completion", {"prompt": "x", "logit_bias": {"\uff11": 1}}, "logit_bias"),  # fullwidth 1
        ("completion", {"prompt": "x", "logit_bias": {"01": 1, "1": 2}}, "logit_bias"),
        ("completion", {"prompt": "x", "logit_bias": {"2147483648": 1}}, "logit_bias"),
        ("completion", {"prompt": "x", "logit_bias": {"-1": 1}}, "logit_bias"),
        ("completion", {"prompt": "x", "logit_bias": {"1": True}}, "logit_bias"),
        ("completion", {"prompt": "x", "logit_bias": {"1": float("nan")}}, "logit_bias"),
        ("chat", {"messages": [{"role": "u", "content": "x"}], "logit_bias": [1]}, "logit_bias"),
        ("chat", {"messages": []}, "messages"),
        ("chat", {"messages": [{"content": "x"}]}, "messages[0].role"),
        ("chat", {"messages": [{"role": "user", "content": 3}]}, "messages[0].content"),
        ("chat", {"messages": [{"role": "user", "content": "x", "name": 3}]}, "messages[0].name"),
        ("chat", {"messages": [{"role": "user", "content": "x"}], "logprobs": 1}, "logprobs"),
        ("chat", {"messages": [{"role": "u", "content": "x"}], "max_completion_tokens": 0},
         "max_completion_tokens"),
        ("chat", {"messages": [{"role": "u", "content": "x"}], "tools": [{}]}, "tools"),
        ("completion", {"prompt": "x", "cache_salt": ""}, "cache_salt"),
        ("chat", {"messages": [{"role": "u", "content": "x"}], "cache_salt": 7}, "cache_salt"),
    ],
)  # fmt: skip
def test_bad_bodies_are_400_naming_the_param(kind: Any, body: Any, param: str | None) -> None:
    with pytest.raises(ApiError) as caught:
        parse(body, kind)
    assert caught.value.status == 400 and caught.value.param == param
    if param is not None:
        assert caught.value.message.startswith(param)


def logprob(token_id: int, text: str, lp: float) -> generation_pb2.TokenLogprobs:
    return generation_pb2.TokenLogprobs(
        token_id=token_id, logprob=lp, token=text,
        top_token_ids=[token_id, 9], top_logprobs=[lp, -3.0], top_tokens=[text, "z"],
    )  # fmt: skip


def responses() -> list[generation_pb2.GenerateResponse]:
    usage = generation_pb2.Usage(prompt_tokens=3, completion_tokens=2, cached_tokens=1)
    stop = generation_pb2.FINISH_REASON_STOP
    return [
        generation_pb2.GenerateResponse(index=1, text="é", logprobs=[logprob(5, "é", -0.5)]),
        generation_pb2.GenerateResponse(index=0, text="ab", token_ids=[1, 2], usage=usage,
                                        finish_reason=stop,
                                        logprobs=[logprob(1, "a", -1.0), logprob(2, "", -2.0)]),
        generation_pb2.GenerateResponse(index=1, text="c", usage=usage, finish_reason=stop,
                                        logprobs=[logprob(6, "c", -0.25)]),
    ]  # fmt: skip


def test_final_answers_sum_usage_over_choices_and_shape_logprobs() -> None:
    chat = Answer("chat", "chatcmpl-1", "m", logprobs=1, n=2)  # choices 0, 1 of one prompt
    completion = Answer("completion", "cmpl-1", "m", logprobs=1, n=2)
    for response in responses():
        chat.keep(response)
        completion.keep(response)
    body = chat.final()
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7,
                             "prompt_tokens_details": {"cached_tokens": 1}}  # fmt: skip
    first, second = body["choices"]
    assert first["message"] == {"role": "assistant", "content": "ab"}
    assert second["message"]["content"] == "éc" and second["finish_reason"] == "stop"
    entry = second["logprobs"]["content"][0]
    assert entry["token"] == "é" and entry["bytes"] == [0xC3, 0xA9]
    assert entry["top_logprobs"][1] == {"token": "z", "logprob": -3.0, "bytes": [122]}
    lp = completion.final()["choices"][0]["logprobs"]
    assert lp["tokens"] == ["a", "token_id:2"]  # a token without text is named by its id
    assert lp["token_logprobs"] == [-1.0, -2.0] and lp["text_offset"] == [0, 1]
    assert lp["top_logprobs"][0] == {"a": -1.0, "z": -3.0}


def test_stream_chunks_send_the_role_once_and_offsets_continue() -> None:
    chat = Answer("chat", "chatcmpl-1", "m", logprobs=None)
    roles = [chat.role_chunk(i) for i in (0, 1)]  # vLLM's first chunks: the role, no text
    assert [r["choices"] for r in roles] == [
        [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
          "finish_reason": None}] for i in (0, 1)
    ]  # fmt: skip
    assert "usage" not in roles[0] and roles[0]["object"] == "chat.completion.chunk"
    assert chat.role_chunk(0, usage=True)["usage"] is None
    assert chat.role_chunk(1, 7)["usage"] == {"prompt_tokens": 7, "completion_tokens": 0,
                                              "total_tokens": 7}  # fmt: skip
    chunks = [chat.chunk(r) for r in responses()]
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert deltas == [{"content": "é"}, {"content": "ab"}, {"content": "c"}]
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None, "stop", "stop"]
    assert chunks[0]["object"] == "chat.completion.chunk"
    assert chunks[0]["choices"][0]["logprobs"] is None
    assert chat.usage_chunk()["usage"]["completion_tokens"] == 4
    completion = Answer("completion", "cmpl-1", "m", logprobs=0)
    offsets = [completion.chunk(r)["choices"][0]["logprobs"]["text_offset"] for r in responses()]
    assert offsets == [[0], [0, 1], [1]]


def test_a_batch_of_prompts_sums_each_prompts_usage_once() -> None:
    """Choice i belongs to prompt i // n: prompt tokens count once per prompt (every choice
    of a prompt reports them), completion tokens once per choice."""
    answer = Answer("completion", "cmpl-1", "m", logprobs=None, n=2)
    stop = generation_pb2.FINISH_REASON_STOP
    for index, (prompt_tokens, cached) in enumerate([(3, 1), (3, 0), (7, 4), (7, 4)]):
        usage = generation_pb2.Usage(prompt_tokens=prompt_tokens, completion_tokens=index + 1,
                                     cached_tokens=cached)  # fmt: skip
        answer.keep(generation_pb2.GenerateResponse(index=index, text=str(index), usage=usage,
                                                    finish_reason=stop))  # fmt: skip
    body = answer.final()
    assert [c["text"] for c in body["choices"]] == ["0", "1", "2", "3"]
    assert body["usage"] == {"prompt_tokens": 10, "completion_tokens": 10, "total_tokens": 20,
                             "prompt_tokens_details": {"cached_tokens": 5}}  # fmt: skip


def test_completion_batches_become_one_request_per_prompt() -> None:
    parsed = parse({"prompt": ["a", "b"], "n": 2, "logprobs": 1, "max_tokens": 3}, "completion")
    assert [r.text for r in parsed.requests] == ["a", "b"] and parsed.n == 2
    assert all(r.sampling.logprobs == 1 and r.sampling.max_tokens == 3 for r in parsed.requests)
    tokens = parse({"prompt": [[1, 2], [3]]}, "completion")
    assert [list(r.token_ids.ids) for r in tokens.requests] == [[1, 2], [3]]
    assert len(parse({"prompt": [[1, 2]]}, "completion").requests) == 1  # a batch of one
    assert len(parse({"prompt": [1, 2]}, "completion").requests) == 1  # one token prompt
    for bad, param in (
        (["a", 3], "prompt"),
        ([[1], []], "prompt[1]"),
        ([[1], "a", ""], "prompt[2]"),
    ):
        with pytest.raises(ApiError) as caught:
            parse({"prompt": bad}, "completion")
        assert caught.value.param == param


def test_vllm_cache_salt_salts_every_request_of_the_body() -> None:
    """vLLM's `cache_salt` reaches each prompt's GenerateRequest (UTF-8), chat's too; without
    it (or null) the requests are unsalted and share the prefix cache."""
    batch = parse({"prompt": ["a", "b"], "cache_salt": "tenant-é"}, "completion")
    assert [r.cache_salt for r in batch.requests] == ["tenant-é".encode()] * 2
    chat = parse({"messages": [{"role": "u", "content": "x"}], "cache_salt": "t"}, "chat")
    assert chat.request.cache_salt == b"t"
    assert parse({"prompt": "a", "cache_salt": None}, "completion").request.cache_salt == b""
    assert parse({"prompt": "a"}, "completion").request.cache_salt == b""


def test_echo_asks_the_worker_for_what_the_door_lacks() -> None:
    """A text prompt's echo is its own text; a token prompt's text, and the prompt's logprobs
    when logprobs are asked for, come from the worker (sampling.prompt_logprobs)."""
    text = parse({"prompt": "x", "echo": True}, "completion")
    assert text.echo and not text.request.sampling.HasField("prompt_logprobs")
    tokens = parse({"prompt": [1, 2], "echo": True}, "completion")
    assert tokens.request.sampling.prompt_logprobs == 0
    scored = parse({"prompt": "x", "echo": True, "logprobs": 2}, "completion")
    assert scored.request.sampling.prompt_logprobs == 2
    only = parse({"prompt": "x", "echo": True, "max_tokens": 0}, "completion")
    assert only.prompt_only and only.request.sampling.max_tokens == 1
    assert not parse({"prompt": "x", "logprobs": 2}, "completion").request.sampling.HasField(
        "prompt_logprobs"
    )


def test_echo_starts_each_choice_with_its_prompt_and_its_logprobs() -> None:
    prompt_lp = [
        generation_pb2.TokenLogprobs(token_id=7, logprob=float("nan"), token="He"),
        logprob(8, "llo", -0.75),
    ]
    usage = generation_pb2.Usage(prompt_tokens=2, completion_tokens=1)
    stop = generation_pb2.FINISH_REASON_STOP
    first = generation_pb2.GenerateResponse(
        index=0, text="!", token_ids=[3], logprobs=[logprob(3, "!", -0.5)], usage=usage,
        finish_reason=stop, prompt_logprobs=prompt_lp, prompt_text="Hello",
    )  # fmt: skip
    answer = Answer("completion", "cmpl-1", "m", logprobs=1, echo=Echo([""]))
    answer.keep(first)
    (choice,) = answer.final()["choices"]
    assert choice["text"] == "Hello!"
    lp = choice["logprobs"]
    assert lp["tokens"] == ["He", "llo", "!"] and lp["token_logprobs"] == [None, -0.75, -0.5]
    assert lp["top_logprobs"][0] is None and lp["text_offset"] == [0, 2, 5]
    streamed = Answer("completion", "cmpl-1", "m", logprobs=None, echo=Echo(["Hi"]))
    chunk = streamed.chunk(generation_pb2.GenerateResponse(index=0, text="!", token_ids=[3]))
    assert chunk["choices"][0]["text"] == "Hi!"
    later = streamed.chunk(generation_pb2.GenerateResponse(index=0, text="?", token_ids=[4]))
    assert later["choices"][0]["text"] == "?"  # the prompt comes once
    only = Answer("completion", "cmpl-1", "m", logprobs=1, echo=Echo([""], prompt_only=True))
    only.keep(first)
    (choice,) = only.final()["choices"]
    assert (choice["text"], choice["finish_reason"]) == ("Hello", "length")
    assert choice["logprobs"]["tokens"] == ["He", "llo"]
    assert only.final()["usage"]["completion_tokens"] == 0


def test_echo_text_offsets_point_into_the_returned_text() -> None:
    """With echo, text_offset is where each token starts in the returned text and never
    decreases: a special token the echoed prompt lacks takes no room, the pieces of a
    character split over tokens start where the character does."""
    prompt_lp = [
        generation_pb2.TokenLogprobs(token_id=1, logprob=float("nan"), token="<bos>"),
        logprob(72, "H", -0.5), logprob(105, "i", -0.25),
    ]  # fmt: skip
    generated = [logprob(195, "\ufffd", -1.0), logprob(169, "\ufffd", -1.5), logprob(33, "!", -2)]
    done = generation_pb2.GenerateResponse(
        index=0, text="é!", token_ids=[195, 169, 33], logprobs=generated,
        finish_reason=generation_pb2.FINISH_REASON_LENGTH, prompt_logprobs=prompt_lp,
    )  # fmt: skip
    answer = Answer("completion", "cmpl-1", "m", logprobs=0, echo=Echo(["Hi"]))
    answer.keep(done)
    (choice,) = answer.final()["choices"]
    assert choice["text"] == "Hié!"
    assert choice["logprobs"]["text_offset"] == [0, 0, 1, 2, 2, 3]
    streamed = Answer("completion", "cmpl-1", "m", logprobs=0, echo=Echo(["Hi"]))
    offsets = streamed.chunk(done)["choices"][0]["logprobs"]["text_offset"]
    assert offsets[:3] == [0, 0, 1] and offsets == sorted(offsets)


def test_vllm_prompt_logprobs_per_choice_and_at_the_top_of_chat() -> None:
    """vLLM's shape: per prompt token None (the first) or {id: {logprob, rank, decoded_token}}
    for the prompt token and the top alternatives; the larger of echo's and the field's k is
    asked of the worker, and echo shows only `logprobs` alternatives."""
    parsed = parse({"prompt": "x", "echo": True, "logprobs": 1, "prompt_logprobs": 3},
                   "completion")  # fmt: skip
    assert parsed.request.sampling.prompt_logprobs == 3 and parsed.prompt_logprobs == 3
    scored = generation_pb2.TokenLogprobs(
        token_id=8, logprob=-0.75, token="llo", rank=2, top_token_ids=[9, 8],
        top_logprobs=[-0.5, -0.75], top_tokens=["lp", "llo"],
    )  # fmt: skip
    prompt_lp = [generation_pb2.TokenLogprobs(token_id=7, logprob=float("nan"), token="He"), scored]
    stop = generation_pb2.FINISH_REASON_STOP
    first = generation_pb2.GenerateResponse(
        index=0, text="!", prompt_logprobs=prompt_lp, finish_reason=stop
    )
    answer = Answer("completion", "cmpl-1", "m", logprobs=1, echo=Echo(["Hello"]),
                    prompt_logprobs=3)  # fmt: skip
    answer.keep(first)
    (choice,) = answer.final()["choices"]
    assert choice["prompt_logprobs"] == [
        None,
        {"8": {"logprob": -0.75, "rank": 2, "decoded_token": "llo"},
         "9": {"logprob": -0.5, "rank": 1, "decoded_token": "lp"}},
    ]  # fmt: skip
    # echo: logprobs=1 alternatives, and the prompt token
    assert choice["logprobs"]["top_logprobs"][1] == {"lp": -0.5, "llo": -0.75}
    chat = Answer("chat", "chatcmpl-1", "m", logprobs=None, prompt_logprobs=0)
    chat.keep(first)
    body = chat.final()
    assert body["prompt_logprobs"][1] == {"8": {"logprob": -0.75, "rank": 2,
                                                "decoded_token": "llo"}}  # fmt: skip
    assert "prompt_logprobs" not in body["choices"][0]


def test_echo_without_generation_keeps_an_abort() -> None:
    abort = generation_pb2.GenerateResponse(
        index=0, finish_reason=generation_pb2.FINISH_REASON_ABORT
    )
    only = Answer("completion", "cmpl-1", "m", logprobs=None, echo=Echo(["x"], prompt_only=True))
    only.keep(abort)
    assert only.final()["choices"][0]["finish_reason"] == "abort"


CHAT = [{"role": "user", "content": "x"}]


@pytest.mark.parametrize(
    ("kind", "body", "param"),
    [
        ("chat", {"messages": CHAT, "tool_choice": "required"}, "tool_choice"),
        ("chat", {"messages": CHAT, "tool_choice": {"type": "function"}}, "tool_choice"),
        ("chat", {"messages": CHAT, "echo": True}, "echo"),
        ("chat", {"messages": CHAT, "continue_final_message": True}, "continue_final_message"),
        ("chat", {"messages": CHAT, "chat_template": "{{ x }}"}, "chat_template"),
        ("chat", {"messages": CHAT, "modalities": ["text", "audio"]}, "modalities"),
        ("chat", {"messages": CHAT, "audio": {"voice": "alloy"}}, "audio"),
        ("completion", {"prompt": "x", "guided_choice": ["a", "b"]}, "guided_choice"),
        ("completion", {"prompt": "x", "guided_json": {}}, "guided_json"),
        ("chat", {"messages": CHAT, "guided_regex": "a+"}, "guided_regex"),
        ("chat", {"messages": CHAT, "structured_outputs": {"choice": ["a"]}},
         "structured_outputs"),
        ("completion", {"prompt": "x", "truncate_prompt_tokens": 1}, "truncate_prompt_tokens"),
        ("completion", {"prompt": "x", "use_beam_search": True}, "use_beam_search"),
        ("completion", {"prompt": "x", "allowed_token_ids": [1]}, "allowed_token_ids"),
        ("completion", {"prompt": "x", "bad_words": ["a"]}, "bad_words"),
        ("completion", {"prompt": "x", "logits_processors": ["pkg.mod:Proc"]},
         "logits_processors"),
        ("chat", {"messages": CHAT, "priority": 5}, "priority"),  # requests run first come
        ("completion", {"prompt": "x", "return_tokens_as_token_ids": True},
         "return_tokens_as_token_ids"),
        ("completion", {"prompt": "x", "response_format": {"type": "json_object"}},
         "response_format"),
        ("completion", {"prompt": "x", "prompt_embeds": "AAAA"}, "prompt_embeds"),
        ("chat", {"messages": CHAT, "reasoning_effort": "low"}, "reasoning_effort"),
        ("chat", {"messages": CHAT, "thinking_token_budget": 0}, "thinking_token_budget"),
        ("chat", {"messages": CHAT, "repetition_detection": {"max_pattern_size": 2}},
         "repetition_detection"),
        ("chat", {"messages": CHAT, "logprobs": True, "logprob_token_ids": [1]},
         "logprob_token_ids"),
        ("completion", {"prompt": "x", "return_token_ids": True}, "return_token_ids"),
        ("chat", {"messages": CHAT, "return_prompt_text": True}, "return_prompt_text"),
        ("chat", {"messages": [*CHAT, {"role": "assistant", "content": "y",
                                       "reasoning_content": "z"}]},
         "messages[1].reasoning_content"),
        ("chat", {"messages": [*CHAT, {"role": "tool", "content": "y", "tool_call_id": "c"}]},
         "messages[1].tool_call_id"),
        ("chat", {"messages": [{"role": "developer", "content": "y", "tools": [{}]}]},
         "messages[0].tools"),
        ("chat", {"messages": [{**CHAT[0], "task": "t"}]}, "messages[0].task"),
        ("chat", {"messages": CHAT, "top_logprobs": 1}, "top_logprobs"),
    ],
)  # fmt: skip
def test_unimplemented_features_are_400_naming_the_field(kind: Any, body: Any, param: str) -> None:
    """A field of OpenAI's or vLLM's API that would change the answer, which this server does
    not implement, is refused naming it, never ignored."""
    with pytest.raises(ApiError) as caught:
        parse(body, kind)
    assert caught.value.status == 400 and caught.value.param == param
    assert caught.value.message.startswith(f"{param}: ")


def test_unimplemented_fields_at_their_no_op_values_are_accepted() -> None:
    """Null, or the value that changes nothing (what clients send by default), passes."""
    chat = {
        "messages": CHAT, "tool_choice": "none", "echo": False, "add_generation_prompt": True,
        "continue_final_message": False, "chat_template": None, "chat_template_kwargs": {},
        "add_special_tokens": False, "modalities": ["text"], "guided_json": None,
        "bad_words": [], "use_beam_search": False, "parallel_tool_calls": True,
        "logprob_token_ids": [], "thinking_token_budget": -1, "return_token_ids": False,
        "repetition_detection": {"max_pattern_size": 0}, "return_prompt_text": False,
        "reasoning_effort": None, "documents": None, "top_logprobs": 0,
    }  # fmt: skip
    assert parse(chat, "chat").request.chat.messages[0].content == "x"
    assert parse({**chat, "tool_choice": "auto"}, "chat").request.chat.messages
    unrendered = [{**CHAT[0], "reasoning": "r", "tool_call_id": "c"}]  # vLLM drops them too
    assert parse({**chat, "messages": unrendered}, "chat").request.chat.messages[0].content == "x"
    completion = {"prompt": "x", "add_special_tokens": True, "allowed_token_ids": None,
                  "return_tokens_as_token_ids": False, "truncate_prompt_tokens": None,
                  "response_format": {"type": "text"}, "prompt_embeds": None,
                  "logits_processors": [], "priority": 0}  # fmt: skip
    assert parse(completion, "completion").request.text == "x"


def test_chat_template_options_travel_in_the_chat_message() -> None:
    """vLLM's chat template fields become ChatMessages fields (unset when not given, so the
    workers render as before); chat_template_kwargs and documents travel as compact JSON text;
    a completion's add_special_tokens is the request's."""
    plain = parse({"messages": CHAT}, "chat").request.chat
    assert not plain.HasField("add_generation_prompt") and not plain.continue_final_message
    assert not plain.add_special_tokens and plain.template_kwargs == plain.documents == ""
    kwargs = {"enable_thinking": False, "n": 3, "nested": {"é": [1, 2.5, None]}}
    documents = [{"title": "T", "text": "body"}]
    body = {"messages": [*CHAT, {"role": "assistant", "content": "It is"}],
            "add_generation_prompt": False, "continue_final_message": True,
            "add_special_tokens": True, "chat_template_kwargs": kwargs,
            "documents": documents}  # fmt: skip
    chat = parse(body, "chat").request.chat
    assert chat.HasField("add_generation_prompt") and not chat.add_generation_prompt
    assert chat.continue_final_message and chat.add_special_tokens
    assert json.loads(chat.template_kwargs) == kwargs and json.loads(chat.documents) == documents
    assert " " not in chat.template_kwargs and "é" in chat.template_kwargs  # compact, UTF-8
    assert parse({"messages": CHAT, "add_generation_prompt": True}, "chat").request.chat.HasField(
        "add_generation_prompt"
    )
    completion = parse({"prompt": "x", "add_special_tokens": False}, "completion").request
    assert completion.HasField("add_special_tokens") and not completion.add_special_tokens
    assert not parse({"prompt": "x"}, "completion").request.HasField("add_special_tokens")
    batch = parse({"prompt": ["a", [1, 2]], "add_special_tokens": False}, "completion")
    assert all(r.HasField("add_special_tokens") for r in batch.requests)


@pytest.mark.parametrize(
    ("body", "param", "says"),
    [
        ({"continue_final_message": True}, "continue_final_message", "add_generation_prompt"),
        ({"continue_final_message": True, "add_generation_prompt": True},
         "continue_final_message", "add_generation_prompt"),
        ({"add_generation_prompt": "yes"}, "add_generation_prompt", "boolean"),
        ({"continue_final_message": 1}, "continue_final_message", "boolean"),
        ({"add_special_tokens": "true"}, "add_special_tokens", "boolean"),
        ({"chat_template_kwargs": [1]}, "chat_template_kwargs", "object"),
        ({"chat_template_kwargs": "{}"}, "chat_template_kwargs", "object"),
        ({"chat_template_kwargs": {"chat_template": "{{ 1 }}"}}, "chat_template_kwargs",
         "--trust-request-chat-template"),
        ({"chat_template_kwargs": {"tools": [{"type": "function"}]}}, "chat_template_kwargs",
         "tool calling"),
        ({"chat_template_kwargs": {"x": "y" * 70000}}, "chat_template_kwargs", "65536"),
        ({"chat_template": "{{ 1 }}"}, "chat_template", "--trust-request-chat-template"),
        ({"documents": "abc"}, "documents", "array"),
        ({"documents": [{"title": 1}]}, "documents[0]", "strings"),
        ({"documents": [{"title": "a"}, "b"]}, "documents[1]", "strings"),
    ],
)  # fmt: skip
def test_bad_chat_template_options_are_400_naming_the_field(
    body: dict[str, Any], param: str, says: str
) -> None:
    with pytest.raises(ApiError) as caught:
        parse({"messages": CHAT, **body}, "chat")
    assert caught.value.status == 400 and caught.value.param == param
    assert caught.value.message.startswith(f"{param}: ") and says in caught.value.message


def test_chat_text_parts_join_with_newlines_as_vllm_joins_them() -> None:
    """A message's text parts are separate blocks: joined by "\\n" (vLLM's rendering of an
    array of text parts for a string chat template), never run together."""
    parts = [{"type": "text", "text": "You are brief."}, {"type": "text", "text": "Say hi."}]
    parsed = parse({"messages": [{"role": "system", "content": parts}]}, "chat")
    assert parsed.request.chat.messages[0].content == "You are brief.\nSay hi."
    one = parse({"messages": [{"role": "user", "content": parts[:1]}]}, "chat")
    assert one.request.chat.messages[0].content == "You are brief."


def test_completion_top_logprobs_include_the_sampled_token() -> None:
    """Completions' top_logprobs hold the `logprobs` most likely tokens and the sampled one
    (OpenAI's "up to logprobs + 1", as vLLM answers): with logprobs 0 just the sampled token,
    and a sampled token outside the top ones last, keeping the values descending."""
    drawn = generation_pb2.TokenLogprobs(
        token_id=4, logprob=-2.5, token="d", rank=3, top_token_ids=[9, 8],
        top_logprobs=[-0.5, -1.0], top_tokens=["z", "y"],
    )  # fmt: skip
    done = generation_pb2.GenerateResponse(
        index=0, text="d", token_ids=[4], logprobs=[drawn],
        finish_reason=generation_pb2.FINISH_REASON_LENGTH,
    )  # fmt: skip
    answer = Answer("completion", "cmpl-1", "m", logprobs=2)
    answer.keep(done)
    top = answer.final()["choices"][0]["logprobs"]["top_logprobs"]
    assert top == [{"z": -0.5, "y": -1.0, "d": -2.5}]
    assert list(top[0].values()) == sorted(top[0].values(), reverse=True)
    alone = generation_pb2.TokenLogprobs(token_id=4, logprob=-2.5, token="d", rank=3)
    streamed = Answer("completion", "cmpl-1", "m", logprobs=0)
    chunk = streamed.chunk(generation_pb2.GenerateResponse(index=0, text="d", logprobs=[alone]))
    assert chunk["choices"][0]["logprobs"]["top_logprobs"] == [{"d": -2.5}]


def test_an_assistant_messages_tool_calls_are_refused_not_dropped() -> None:
    """A replayed tool call (an assistant message's `tool_calls`) is not rendered by this
    server: refused naming it rather than dropped from the prompt; an empty list is no call."""
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    messages = [CHAT[0], {"role": "assistant", "content": None, "tool_calls": [call]}]
    with pytest.raises(ApiError) as caught:
        parse({"messages": messages}, "chat")
    assert caught.value.param == "messages[1].tool_calls"
    messages[1]["tool_calls"] = []
    assert parse({"messages": messages}, "chat").request.chat.messages[1].content == ""


@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_an_infinite_logprob_is_sent_as_vllms_floor(kind: Any) -> None:
    """A token the model rules out has logprob -inf, which JSON cannot carry (the final body's
    encoder refused it: a 500 after the whole generation); it goes out as -9999.0."""
    import json

    answer = Answer(kind, "id-1", "m", logprobs=1, n=1)
    answer.keep(generation_pb2.GenerateResponse(
        index=0, text="a", token_ids=[1], finish_reason=generation_pb2.FINISH_REASON_STOP,
        logprobs=[logprob(1, "a", float("-inf"))],
    ))  # fmt: skip
    body = json.loads(json.dumps(answer.final(), allow_nan=False))
    lp = body["choices"][0]["logprobs"]
    values = [lp["content"][0]["logprob"]] if kind == "chat" else lp["token_logprobs"]
    assert values == [-9999.0]


@pytest.mark.parametrize(
    "seed, wire",
    [(0, 0), (7, 7), (2**63 - 1, 2**63 - 1), (-1, 2**63 - 1), (-5, 2**63 - 5), (-(2**63), 0)],
)
def test_any_int64_seed_is_taken_as_its_low_63_bits(seed: int, wire: int) -> None:
    """OpenAI's and vLLM's seed is any int64; the workers draw from seeds in [0, 2**63), where
    a negative one is folded (the same seed always the same wire seed, so the same draws)."""
    parsed = parse({"prompt": "x", "seed": seed}, "completion")
    assert parsed.request.sampling.seed == wire


@pytest.mark.parametrize("seed", [2**63, -(2**63) - 1])
def test_a_seed_beyond_int64_is_400_naming_it(seed: int) -> None:
    with pytest.raises(ApiError) as caught:
        parse({"prompt": "x", "seed": seed}, "completion")
    assert caught.value.status == 400 and caught.value.param == "seed"


def scored(token_id: int, text: str, own: float, alternative: float) -> Any:
    """A token's logprobs: its own and one alternative's (token 9, "z")."""
    return generation_pb2.TokenLogprobs(token_id=token_id, token=text, logprob=own,
                                        top_token_ids=[9], top_tokens=["z"],
                                        top_logprobs=[alternative])  # fmt: skip


@pytest.mark.parametrize("kind", ["chat", "completion"])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_a_non_finite_logprob_is_sent_as_vllms_floor_streamed_or_not(
    kind: Any, value: float
) -> None:
    """A logprob the engine sends non-finite (a NaN row of raw logprobs, -inf for a ruled-out
    token) goes out as -9999.0, a token's and its alternatives', vLLM's prompt_logprobs too:
    the final body's encoder refused NaN and infinity (a 500 after the whole generation) and
    a stream's event carried NaN or -Infinity, which is not JSON. (A completion token or a
    prompt token whose own logprob is NaN stays unscored: null, as a prompt's first token.)"""
    nan = math.isnan(value)
    prompt = [generation_pb2.TokenLogprobs(token_id=7, token="x", logprob=math.nan),
              scored(8, "y", value, value), scored(8, "y", -1.0, value)]  # fmt: skip
    response = generation_pb2.GenerateResponse(
        index=0, text="ab", token_ids=[1, 2], finish_reason=generation_pb2.FINISH_REASON_STOP,
        logprobs=[scored(1, "a", value, value), scored(2, "b", -1.0, value)],
        prompt_logprobs=prompt,
    )  # fmt: skip
    streamed = Answer(kind, "id-1", "m", logprobs=1, prompt_logprobs=1)
    whole = Answer(kind, "id-1", "m", logprobs=1, prompt_logprobs=1)
    whole.keep(response)
    chunk = json.loads(sse(streamed.chunk(response)).removeprefix("data: "))  # strict JSON
    final = json.loads(json.dumps(whole.final(), allow_nan=False))
    low = -9999.0
    for body in (chunk, final):
        choice = body["choices"][0]
        prompt_lp = (body if kind == "chat" else choice)["prompt_logprobs"]
        assert prompt_lp[0] is None and prompt_lp[2] == {
            "8": {"logprob": -1.0, "rank": None, "decoded_token": "y"},
            "9": {"logprob": low, "rank": 1, "decoded_token": "z"},
        }
        if nan:
            assert prompt_lp[1] is None
        else:
            assert {k: v["logprob"] for k, v in prompt_lp[1].items()} == {"8": low, "9": low}
        lp = choice["logprobs"]
        if kind == "chat":
            own = [e["logprob"] for e in lp["content"]]
            alternatives = [e["top_logprobs"][0]["logprob"] for e in lp["content"]]
            assert (own, alternatives) == ([low, -1.0], [low, low])
        else:
            assert lp["token_logprobs"] == [None if nan else low, -1.0]
            assert lp["top_logprobs"] == [None if nan else {"z": low, "a": low},
                                          {"z": low, "b": -1.0}]  # fmt: skip
