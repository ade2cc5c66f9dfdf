"""The default model (SmolLM2-135M-Instruct, converted from its GGUF package once into the kvmesh
cache): greedy tokens identical to transformers' `generate` on the same folder, through the chat
template and on plain text, and it answers a question correctly."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from kvmesh import LLM, SamplingParams
from kvmesh.models.default import default_model_path

NEW_TOKENS = 16
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return default_model_path()


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def llm(model_dir: Path) -> LLM:
    return LLM(str(model_dir), num_kv_blocks=32, max_model_len=256)


def _prompts(tokenizer: Any) -> list[list[int]]:
    chat = tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=False)
    plain = "Paged attention keeps the KV cache in"
    return [tokenizer.encode(text, add_special_tokens=False) for text in (chat, plain)]


def test_greedy_matches_transformers(model_dir: Path, tokenizer: Any, llm: LLM) -> None:
    from transformers import AutoModelForCausalLM

    prompts = _prompts(tokenizer)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    ours = [list(out.outputs[0].token_ids) for out in llm.generate(prompts, params)]
    reference = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    for prompt, tokens in zip(prompts, ours, strict=True):
        with torch.no_grad():
            out = reference.generate(
                torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False,
                eos_token_id=None,
            )  # fmt: skip
        assert tokens == out[0, len(prompt) :].tolist(), tokenizer.decode(tokens)


def test_answers_the_capital_of_france(tokenizer: Any, llm: LLM) -> None:
    (output,) = llm.generate(_prompts(tokenizer)[:1], SamplingParams(temperature=0.0))
    completion = output.outputs[0]
    assert "Paris" in completion.text
    assert completion.finish_reason == "stop"  # ends at <|im_end|>, the template's turn end
