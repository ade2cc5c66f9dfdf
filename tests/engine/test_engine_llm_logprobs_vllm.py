"""`LLM` logprobs read as vLLM's: each position of `CompletionOutput.logprobs` and of
`RequestOutput.prompt_logprobs` is a `Mapping[int, Logprob]` (the sampled or prompt token first,
then the top-n; the top tokens ranked 1..n, the sampled one at its true rank otherwise) whose
`Logprob` has `.logprob`, `.rank` and `.decoded_token` (vLLM's texts: each token decoded alone,
a partial UTF-8 character completed by the tokens before it or "")."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest

from kvmesh import LLM, Logprob, SamplingParams
from kvmesh.engine.logprobs import DecodedTokens, TokenLogprobs
from kvmesh.engine.outputs import Logprob as OutputsLogprob
from kvmesh.models.tiny import build_tiny_model
from kvmesh.models.tokenizer import set_chat_template

SAMPLED = SamplingParams(temperature=1.0, seed=7, max_tokens=8, ignore_eos=True, logprobs=3)


@pytest.fixture(scope="module")
def llm(tmp_path_factory: pytest.TempPathFactory) -> LLM:
    checkpoint = build_tiny_model(tmp_path_factory.mktemp("lp"), "llama", "test", seed=0)
    set_chat_template(checkpoint)
    return LLM(model=str(checkpoint), num_kv_blocks=64, max_model_len=256, num_threads=1)


def check_position(entry: Any, top_n: int) -> None:
    """One position read the vLLM way agrees with the TokenLogprobs fields."""
    assert isinstance(entry, TokenLogprobs) and entry  # truthy, the fields still there
    sampled, top = entry.sampled_token_id, entry.top_token_ids
    assert len(top) == top_n
    keys = [token_id for token_id, _ in entry.items()]
    assert keys == [sampled, *(t for t in top if t != sampled)]  # vLLM's insertion order
    assert len(entry) == len(keys) == len(set(keys))
    assert all(t in entry for t in keys) and -1 not in entry and entry.get(-1) is None
    for rank, (token_id, value) in enumerate(zip(top, entry.top_logprobs, strict=True), 1):
        assert entry[token_id].logprob == value and entry[token_id].rank == rank
    if sampled not in top:
        assert entry[sampled].logprob == entry.sampled_logprob
        assert entry[sampled].rank == entry.sampled_rank > top_n
    else:
        assert entry[sampled].logprob == entry.sampled_logprob
    assert entry == {t: lp for t, lp in entry.items()}  # equal to vLLM's dict


def check_texts(entry: TokenLogprobs, tokenizer: Any, before: list[int]) -> None:
    """Each text is the token's own decode, or, for part of a UTF-8 character, what the
    preceding token completes it to ("" when it does not)."""
    for token_id, lp in entry.items():
        assert isinstance(lp.decoded_token, str)
        alone = tokenizer.decode([token_id])
        if not alone.endswith("\ufffd"):
            assert lp.decoded_token == alone
        elif before and not tokenizer.decode([before[-1]]).endswith("\ufffd"):
            with_previous = tokenizer.decode([before[-1], token_id])
            if with_previous.endswith("\ufffd"):
                continue  # a longer context may complete it
            assert lp.decoded_token == with_previous[len(tokenizer.decode([before[-1]])) :]


def test_sample_logprobs_read_as_vllm_dicts(llm: LLM) -> None:
    (out,) = llm.generate([5, 17, 300, 41], SAMPLED)
    completion = out.outputs[0]
    assert completion.logprobs is not None and len(completion.logprobs) == 8
    tokenizer = llm.get_tokenizer()
    for i, position in enumerate(completion.logprobs):
        check_position(position, top_n=3)
        assert position.sampled_token_id == completion.token_ids[i]
        check_texts(position, tokenizer, completion.token_ids[:i])
        for token_id, lp in position.items():  # the loop of a vLLM script
            assert isinstance(lp, Logprob) and isinstance(token_id, int)
            assert lp.rank is not None and lp.rank >= 1 and math.isfinite(lp.logprob)
    total = sum(
        p[t].logprob for p, t in zip(completion.logprobs, completion.token_ids, strict=True)
    )
    assert completion.cumulative_logprob == pytest.approx(total)
    assert Logprob is OutputsLogprob


def test_prompt_logprobs_read_as_vllm_dicts_with_texts(llm: LLM) -> None:
    tokenizer = llm.get_tokenizer()
    prompt = "ab\u00e9c"  # é: two byte tokens, each U+FFFD alone
    ids = tokenizer.encode(prompt)
    params = SamplingParams(max_tokens=1, temperature=0.0, logprobs=0, prompt_logprobs=2)
    (out,) = llm.generate(prompt, params)
    entries = out.prompt_logprobs
    assert entries is not None and out.prompt_token_ids == ids
    assert len(entries) == len(ids) and entries[0] is None
    for p, entry in enumerate(entries[1:], 1):
        assert entry is not None
        check_position(entry, top_n=2)
        assert next(iter(entry)) == ids[p]  # the prompt token first
        check_texts(entry, tokenizer, ids[:p])
    texts = [e[ids[p]].decoded_token for p, e in enumerate(entries) if e is not None]
    assert texts == ["a", "b", "", "\u00e9", "c"]  # vLLM: the first byte "", the second "é"
    (sampled,) = out.outputs[0].logprobs or []
    assert len(sampled) == 1 and sampled[out.outputs[0].token_ids[0]].rank == 1  # greedy


def test_chat_logprobs_have_texts(llm: LLM) -> None:
    messages = [{"role": "user", "content": "Hi"}]
    (out,) = llm.chat(messages, SAMPLED)
    logprobs = out.outputs[0].logprobs
    assert logprobs is not None and len(logprobs) == 8
    for position in logprobs:
        check_position(position, top_n=3)
        assert all(lp.decoded_token is not None for lp in position.values())


def test_no_texts_without_detokenizing_and_same_numbers(llm: LLM) -> None:
    params = SamplingParams(
        temperature=1.0, seed=7, max_tokens=8, ignore_eos=True, logprobs=3, detokenize=False
    )
    (bare,) = llm.generate([5, 17, 300, 41], params)
    (texts,) = llm.generate([5, 17, 300, 41], SAMPLED)
    assert bare.outputs[0].logprobs == texts.outputs[0].logprobs  # texts aside, the same
    for position in bare.outputs[0].logprobs or []:
        check_position(position, top_n=3)
        assert position.decoded_tokens is None
        assert all(lp.decoded_token is None for lp in position.values())


def test_zero_top_logprobs_hold_the_sampled_token_only(llm: LLM) -> None:
    params = SamplingParams(temperature=1.0, seed=1, max_tokens=4, ignore_eos=True, logprobs=0)
    (out,) = llm.generate([5, 17], params)
    logprobs = out.outputs[0].logprobs
    assert logprobs is not None
    for token_id, position in zip(out.outputs[0].token_ids, logprobs, strict=True):
        assert position.decoded_tokens is not None
        assert list(position) == [token_id] and len(position) == 1
        assert position[token_id] == Logprob(
            position.sampled_logprob, position.sampled_rank, position.decoded_tokens[0]
        )


class MetaspaceTokenizer:
    """A SentencePiece-like tokenizer whose decode of one token drops its leading space."""

    def __init__(self) -> None:
        self.pieces = {1: "\u2581the", 2: "cat", 3: "\u2581\u2581x"}

    class backend_tokenizer:  # the attribute a transformers tokenizer has
        @staticmethod
        def to_str() -> str:
            return json.dumps({"pre_tokenizer": {"type": "Metaspace", "replacement": "\u2581"}})

    def decode(self, ids: list[int]) -> str:
        return "".join(self.pieces[i] for i in ids).replace("\u2581", " ").lstrip(" ")

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str]:
        return [self.pieces[i] for i in ids]


def test_a_metaspace_tokens_leading_space_is_kept_as_vllm_keeps_it() -> None:
    decoded = DecodedTokens(MetaspaceTokenizer())
    assert decoded.marker == "\u2581"
    assert decoded.texts([1, 2, 3], []) == (" the", "cat", "  x")
