"""ModelRunner + paged attention vs transformers' own greedy `generate` (token-identical).

A minimal driver plays the scheduler: each sequence owns a disjoint range of blocks, prompts are
fed in chunks of `chunk` tokens, and every step mixes single-token decodes (first) with prefill
chunks, exactly the flat batches the real scheduler produces.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch

from kvmesh.engine.config import EngineConfig
from kvmesh.engine.errors import InvalidParameterError, UnsupportedModelError
from kvmesh.engine.loader import load_model
from kvmesh.engine.runner import ModelRunner
from kvmesh.engine.scheduler.plan import NewSeq, ScheduledChunk, plan_of_chunks
from kvmesh.models.tiny import build_tiny_model

BLOCK_SIZE = 4
MAX_BLOCKS_PER_SEQ = 64


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3", "mistral"])
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp(request.param), request.param, "test", seed=0)


PROMPT_LENGTHS = (3, 17, 90)  # 90 crosses the test-size sliding window (64)
MAX_NEW = 16


def make_prompts() -> list[list[int]]:
    rng = random.Random(1)
    return [[rng.randrange(10, 1000) for _ in range(n)] for n in PROMPT_LENGTHS]


@pytest.fixture(scope="module")
def expected(checkpoint: Path) -> list[list[int]]:
    """transformers' own greedy continuation of each prompt, one prompt at a time."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(checkpoint), attn_implementation="sdpa")
    return [hf_greedy(model, prompt, MAX_NEW) for prompt in make_prompts()]


def hf_greedy(model: Any, prompt: list[int], max_new: int) -> list[int]:
    out = model.generate(
        torch.tensor([prompt]),
        max_new_tokens=max_new,
        min_new_tokens=max_new,
        do_sample=False,
        pad_token_id=0,
    )
    return out[0, len(prompt) :].tolist()


def run_paged(
    runner: ModelRunner, prompts: list[list[int]], max_new: int, chunk: int
) -> list[list[int]]:
    """Greedy-generate every prompt together on the paged cache; returns generated ids."""
    tokens = [list(p) for p in prompts]
    computed = [0] * len(prompts)
    tables = [
        tuple(range(i * MAX_BLOCKS_PER_SEQ, (i + 1) * MAX_BLOCKS_PER_SEQ))
        for i in range(len(prompts))
    ]
    new_seqs = [NewSeq(str(i), table) for i, table in enumerate(tables)]  # sent once
    while any(len(t) - len(p) < max_new for t, p in zip(tokens, prompts, strict=True)):
        active = [i for i in range(len(prompts)) if len(tokens[i]) - len(prompts[i]) < max_new]
        order = sorted(active, key=lambda i: len(tokens[i]) - computed[i] != 1)
        chunks = []
        for i in order:
            end = min(len(tokens[i]), computed[i] + chunk)
            sample = (str(i),) if end == len(tokens[i]) else ()
            chunk_tokens = tuple(tokens[i][computed[i] : end])
            chunks.append(ScheduledChunk(str(i), chunk_tokens, computed[i], tables[i], (), sample))
            computed[i] = end
        plan = plan_of_chunks(chunks, block_size=BLOCK_SIZE, new_seqs=new_seqs)
        new_seqs = []
        logits = runner.execute(plan)
        sampled = [i for i, c in zip(order, chunks, strict=True) if c.sample_seq_ids]
        assert logits.shape == (len(sampled), runner.vocab_size)
        for row, i in enumerate(sampled):
            tokens[i].append(int(logits[row].argmax()))
    return [t[len(p) :] for t, p in zip(tokens, prompts, strict=True)]


def make_runner(path: Path, num_seqs: int) -> ModelRunner:
    loaded = load_model(EngineConfig(model=str(path)))
    return ModelRunner(loaded, num_seqs * MAX_BLOCKS_PER_SEQ, BLOCK_SIZE, "auto")


@pytest.mark.parametrize("chunk", [1000, 7])
def test_greedy_matches_transformers_generate(
    checkpoint: Path, expected: list[list[int]], chunk: int
) -> None:
    """chunk=1000: whole prompts in one step; chunk=7: chunked prefill mixed with decodes."""
    prompts = make_prompts()
    runner = make_runner(checkpoint, len(prompts))
    assert run_paged(runner, prompts, MAX_NEW, chunk) == expected


def test_copy_blocks_copies_every_layer(checkpoint: Path) -> None:
    runner = make_runner(checkpoint, 1)
    runner.kv_cache.data[3].normal_()
    runner.copy_blocks([(3, 5)])
    assert torch.equal(runner.kv_cache.data[5], runner.kv_cache.data[3])
    assert not torch.equal(runner.kv_cache.data[4], runner.kv_cache.data[3])


def test_unsupported_architecture_fails_at_load(tmp_path: Path) -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64)).save_pretrained(
        tmp_path
    )
    with pytest.raises(UnsupportedModelError, match="gpt2"):
        load_model(EngineConfig(model=str(tmp_path)))


def test_head_dim_the_kernels_lack_fails_at_load(tmp_path: Path) -> None:
    from transformers import LlamaConfig

    LlamaConfig(hidden_size=64, num_attention_heads=4, num_hidden_layers=1).save_pretrained(
        tmp_path
    )
    with pytest.raises(UnsupportedModelError, match="head_dim 16 is not supported"):
        load_model(EngineConfig(model=str(tmp_path)))


def test_missing_model_folder_names_the_field(tmp_path: Path) -> None:
    with pytest.raises(InvalidParameterError, match="model"):
        load_model(EngineConfig(model=str(tmp_path / "absent")))
