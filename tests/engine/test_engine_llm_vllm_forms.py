"""`LLM` takes the input forms a vLLM script passes and fills vLLM's output fields: dict prompts
(`{"prompt_token_ids": [...]}`, `{"prompt": "..."}`), `use_tqdm`, and each completion's
`cumulative_logprob`."""

from __future__ import annotations

import math

import pytest

from kvmesh import LLM, SamplingParams
from kvmesh.engine.errors import InvalidParameterError
from kvmesh.models.tiny import build_tiny_model
from kvmesh.models.tokenizer import set_chat_template

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
IDS = [5, 17, 300, 41]


@pytest.fixture(scope="module")
def llm(tmp_path_factory: pytest.TempPathFactory) -> LLM:
    checkpoint = build_tiny_model(tmp_path_factory.mktemp("forms"), "llama", "test", seed=0)
    set_chat_template(checkpoint)
    return LLM(model=str(checkpoint), num_kv_blocks=64, max_model_len=256, num_threads=1)


def test_dict_prompts_read_as_vllm_reads_them(llm: LLM) -> None:
    plain = llm.generate([IDS, "Hello"], GREEDY)
    (single,) = llm.generate({"prompt_token_ids": IDS}, GREEDY)  # not the text of its key
    assert single.prompt_token_ids == IDS and single.prompt is None
    assert single.outputs[0].token_ids == plain[0].outputs[0].token_ids
    batch = llm.generate([{"prompt_token_ids": IDS}, {"prompt": "Hello"}], GREEDY)
    for got, want in zip(batch, plain, strict=True):
        assert (got.prompt, got.prompt_token_ids) == (want.prompt, want.prompt_token_ids)
        assert got.outputs[0].token_ids == want.outputs[0].token_ids


@pytest.mark.parametrize(
    ("prompt", "field"),
    [
        ({"prompt": "Hi", "multi_modal_data": {}}, "multi_modal_data"),
        ({"prompt_token_ids": IDS, "cache_salt": "a"}, "cache_salt"),
        ({"text": "Hi"}, "text"),
        ({}, "prompt"),
        ({"prompt": 5}, "prompt"),
        ({"prompt_token_ids": "Hi"}, "prompt_token_ids"),
    ],
)
def test_a_dict_prompt_kvmesh_cannot_honour_is_refused_naming_the_key(
    llm: LLM, prompt: dict, field: str
) -> None:
    with pytest.raises(InvalidParameterError) as error:
        llm.generate([IDS, prompt], GREEDY)
    assert error.value.field == field
    assert not llm.engine.has_unfinished()


def test_use_tqdm_is_accepted_and_shows_a_bar_when_true(
    llm: LLM, capsys: pytest.CaptureFixture[str]
) -> None:
    quiet = llm.generate([IDS, IDS], GREEDY, use_tqdm=False)
    assert "2/2" not in capsys.readouterr().err
    shown = llm.generate([IDS, IDS], GREEDY, use_tqdm=True)
    assert "2/2" in capsys.readouterr().err
    assert [o.outputs[0].token_ids for o in quiet] == [o.outputs[0].token_ids for o in shown]
    chat = llm.chat([{"role": "user", "content": "Hi"}], GREEDY, use_tqdm=False)
    assert len(chat) == 1 and len(chat[0].outputs[0].token_ids) == 6


def test_cumulative_logprob_sums_the_sampled_tokens_logprobs(llm: LLM) -> None:
    (plain,) = llm.generate([IDS], GREEDY)
    assert plain.outputs[0].cumulative_logprob is None  # vLLM: None unless logprobs asked for
    params = SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=6, ignore_eos=True, logprobs=0)
    (scored,) = llm.generate([IDS], params)
    for completion in scored.outputs:
        assert completion.logprobs is not None and len(completion.logprobs) == 6
        total = sum(lp.sampled_logprob for lp in completion.logprobs)
        assert completion.cumulative_logprob is not None
        assert math.isclose(completion.cumulative_logprob, total, rel_tol=1e-9, abs_tol=1e-9)
        assert completion.cumulative_logprob < 0
