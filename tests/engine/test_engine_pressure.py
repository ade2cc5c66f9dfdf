"""Random shared-prefix workloads on engines squeezed for KV memory (pools of 6-14 blocks,
host and disk tiers of a few blocks, swap / recompute / cost-chosen preemption, chunked
prefill down to 16 tokens, both scheduling policies, one batch or one request at a time):
greedy output equals a roomy engine's without prefix caching (itself held to transformers'
`generate` by the other engine tests), twice in a row on the same engine, and the block
manager's cross-tier integrity check holds after each."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from kvmesh import LLM, SamplingParams
from kvmesh.models.tiny import build_tiny_model

BLOCK_BYTES = 16384  # the tiny llama: 2 layers x (K, V) x 16 tokens x 2 heads x 32 x 4 bytes
Request = tuple[list[int], int]  # prompt, tokens to generate


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("llama"), "llama", "test", seed=0)


@pytest.fixture(scope="module")
def roomy(checkpoint: Path) -> LLM:
    return LLM(str(checkpoint), num_kv_blocks=256, enable_prefix_caching=False)


def workload(rng: random.Random) -> list[Request]:
    """3-9 requests cut from 3 shared prefixes (whole and partial blocks), with own tails,
    generating 4-40 tokens each (no more than the smallest pool, 6 blocks of 16, holds)."""
    sizes = (16, 32, 40, 48, 64)
    prefixes = [[rng.randrange(10, 1000) for _ in range(rng.choice(sizes))] for _ in range(3)]
    requests = []
    for _ in range(rng.randint(3, 9)):
        head = rng.choice(prefixes)[: rng.choice((16, 17, 31, 32, 48, 64))]
        tail = [rng.randrange(10, 1000) for _ in range(rng.randint(1, 12))]
        fits = 6 * 16 - len(head + tail)  # the smallest pool holds the whole sequence
        requests.append((head + tail, min(rng.randint(4, 40), fits)))
    return requests


def squeezed(rng: random.Random, disk_dir: Path) -> dict[str, Any]:
    """An engine configuration short of KV memory everywhere."""
    config: dict[str, Any] = {
        "num_kv_blocks": rng.choice((6, 8, 10, 14)),
        "max_num_batched_tokens": rng.choice((16, 32, 64, 2048)),
        "scheduling_policy": rng.choice(("decode-first", "prefill-first")),
        "preemption": "recompute",
    }
    if rng.random() < 0.8:
        config["host_kv_gib"] = rng.choice((2, 3, 5, 12)) * BLOCK_BYTES / 2**30
        config["preemption"] = rng.choice(("recompute", "swap", "auto"))
        if rng.random() < 0.5:
            config["disk_kv_dir"] = str(disk_dir)
            config["disk_kv_gib"] = rng.choice((4, 8)) * BLOCK_BYTES / 2**30
    return config


def generate(llm: LLM, requests: list[Request], one_by_one: bool) -> list[list[int]]:
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for _, n in requests]
    prompts = [prompt for prompt, _ in requests]
    if one_by_one:
        outputs = [llm.generate([p], [sp])[0] for p, sp in zip(prompts, params, strict=True)]
    else:
        outputs = llm.generate(prompts, params)
    return [list(o.outputs[0].token_ids) for o in outputs]


@pytest.mark.parametrize("seed", range(12))
def test_squeezed_engine_matches_a_roomy_one(
    checkpoint: Path, roomy: LLM, tmp_path: Path, seed: int
) -> None:
    rng = random.Random(seed)
    requests = workload(rng)
    expected = generate(roomy, requests, one_by_one=False)
    config = squeezed(rng, tmp_path)
    one_by_one = rng.random() < 0.3
    llm = LLM(str(checkpoint), **config)
    for attempt in ("cold", "warm"):  # the second pass runs on what the first left cached
        assert generate(llm, requests, one_by_one) == expected, (attempt, config)
        llm.engine.scheduler.block_manager.check_integrity()
