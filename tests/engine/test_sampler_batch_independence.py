"""A seeded row draws the same tokens whatever else its batch holds, also for float16 logits on
CPU, whose batch is widened to float32 when any row has a penalty or a logit_bias: the draw path
follows the model's logits, never that widened copy."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvmesh import LLM, SamplingParams
from kvmesh.engine.sampler import Sampler, SamplingBatch, SamplingRow
from kvmesh.models.tiny import build_tiny_model

PROMPT = [(11 * i + 5) % 900 + 10 for i in range(20)]
NEIGHBOURS = {
    "plain": SamplingParams(),
    "repetition": SamplingParams(repetition_penalty=1.5),
    "presence": SamplingParams(presence_penalty=0.5),
    "logit_bias": SamplingParams(logit_bias={3: 2.0}),
}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("llama"), "llama", "test", seed=0)


def seeded_draws(logits: torch.Tensor, neighbour: SamplingParams) -> list[int]:
    """The seeded row's token at 20 steps, next to a row sampling with `neighbour`."""
    seeded = SamplingParams(seed=7)
    tokens = []
    for step in range(20):
        rows = [SamplingRow(seeded, (1, 2), (3,) * step), SamplingRow(neighbour, (1, 2), (3,))]
        sampler = Sampler(torch.Generator().manual_seed(1))
        tokens.append(int(sampler(logits, SamplingBatch.build(rows)).token_ids[0]))
    return tokens


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_seeded_row_ignores_its_neighbours_penalties_and_biases(dtype: torch.dtype) -> None:
    """Every neighbour gives the seeded row the tokens a plain neighbour gives it."""
    generator = torch.Generator().manual_seed(0)
    logits = (torch.randn(2, 1000, generator=generator) * 2).to(dtype)  # [2, vocab]
    alone = seeded_draws(logits, NEIGHBOURS["plain"])
    for name, neighbour in NEIGHBOURS.items():
        assert seeded_draws(logits, neighbour) == alone, name


def test_float16_engine_seeded_request_ignores_a_penalised_neighbour(checkpoint: Path) -> None:
    """A float16 CPU engine: a seeded request's tokens are the same alone, next to a plain
    request and next to one with a presence penalty or a logit_bias."""
    seeded = SamplingParams(temperature=1.0, seed=42, max_tokens=16, ignore_eos=True)
    llm = LLM(str(checkpoint), num_kv_blocks=64, dtype="float16", device="cpu")
    (alone,) = llm.generate([PROMPT], seeded)
    for name in ("plain", "presence", "logit_bias"):
        other = NEIGHBOURS[name]
        neighbour = SamplingParams(
            max_tokens=16,
            ignore_eos=True,
            presence_penalty=other.presence_penalty,
            logit_bias=other.logit_bias_pairs,
        )
        _, batched = llm.generate([PROMPT[:7], PROMPT], [neighbour, seeded])
        assert batched.outputs[0].token_ids == alone.outputs[0].token_ids, name
