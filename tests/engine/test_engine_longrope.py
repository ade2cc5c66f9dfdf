"""A Llama-family config with `longrope` scaling (transformers' executor: the native one
refuses the rope type) is served within its original context, where its rotation does not
depend on what else a step holds: token-identical to transformers' `generate` for requests
batched together and for a chunked prompt; a longer `max_model_len` is refused by name."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from kvmesh import LLM, SamplingParams
from kvmesh.engine.errors import InvalidParameterError
from kvmesh.models.tokenizer import save_byte_tokenizer

ORIGINAL = 32  # original_max_position_embeddings: the long factors start past it
HALF = 16  # head_dim 32
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
SHORT = [(11 * i + 5) % 900 + 10 for i in range(8)]
LONGER = [(7 * i + 3) % 1000 + 10 for i in range(24)]


@pytest.fixture(scope="module")
def longrope_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        "llama", head_dim=32, vocab_size=1024, hidden_size=128, intermediate_size=256,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=256, original_max_position_embeddings=ORIGINAL,
        tie_word_embeddings=False, initializer_range=0.2, bos_token_id=1, eos_token_id=2,
        pad_token_id=0,
        rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                         "long_factor": [1.0 + 0.5 * i for i in range(HALF)],
                         "short_factor": [1.0] * HALF,
                         "original_max_position_embeddings": ORIGINAL},
    )  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    path = tmp_path_factory.mktemp("longrope")
    model.save_pretrained(str(path))
    save_byte_tokenizer(path, model_max_length=256)
    return path


def generate_alone(path: Path, prompt: list[int], n: int) -> list[int]:
    from transformers import AutoModelForCausalLM

    model: Any = AutoModelForCausalLM.from_pretrained(str(path), attn_implementation="sdpa")
    model.generation_config.eos_token_id = None
    ids = torch.tensor([prompt])
    out = model.generate(ids, max_new_tokens=n, do_sample=False, pad_token_id=0)
    return [int(t) for t in out[0, len(prompt) :]]


def test_longrope_is_served_within_its_original_context(longrope_model: Path) -> None:
    llm = LLM(str(longrope_model), num_kv_blocks=64, dtype="float32", max_num_batched_tokens=16)
    assert llm.engine.parts.max_model_len == ORIGINAL
    together = llm.generate([SHORT, LONGER], GREEDY)  # one step, and LONGER's prompt chunked
    for prompt, output in zip([SHORT, LONGER], together, strict=True):
        assert list(output.outputs[0].token_ids) == generate_alone(longrope_model, prompt, 6)


def test_a_longer_context_for_longrope_is_refused_by_name(longrope_model: Path) -> None:
    with pytest.raises(InvalidParameterError, match=r"max_model_len.*original_max_position"):
        LLM(str(longrope_model), num_kv_blocks=64, dtype="float32", max_model_len=64)
