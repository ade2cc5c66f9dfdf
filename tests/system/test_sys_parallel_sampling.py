"""n > 1 through the front door in disaggregated mode (1 prefill + 1 decode on the tiny test
model): the completions the offline engine samples, interleaved by index, and nothing held
after a cancel."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sys_harness import idle, local_system, used_blocks, wait_until

from kvmesh.cli.up import LocalSystem
from kvmesh.client import Client
from kvmesh.models.tiny import build_tiny_model

SEEDED: dict[str, Any] = {"n": 3, "temperature": 0.9, "seed": 77, "max_tokens": 10}


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("sys-n-llama"), "llama", "test", seed=0)


@pytest.fixture(scope="module")
def tiny_system(tiny_model: Path) -> Iterator[tuple[LocalSystem, str]]:
    with local_system(model=str(tiny_model), transfer_backend="shm") as started:
        yield started


def test_seeded_n3_streams_the_offline_completions_by_index(
    tiny_system: tuple[LocalSystem, str], tiny_model: Path
) -> None:
    from kvmesh import LLM, SamplingParams

    system, endpoint = tiny_system
    prompt = list(range(30, 51))
    with Client(endpoint, timeout=60) as client:
        chunks = list(client.generate(prompt, ignore_eos=True, **SEEDED))
    (offline,) = LLM(model=str(tiny_model)).generate(
        [prompt], SamplingParams(ignore_eos=True, **SEEDED)
    )
    tokens: dict[int, list[int]] = defaultdict(list)
    for chunk in chunks:
        tokens[chunk.index].extend(chunk.token_ids)
    assert tokens == {out.index: out.token_ids for out in offline.outputs}
    assert [c.index for c in chunks[:3]] == [0, 1, 2]  # the first tokens come together
    last = [c for c in chunks if c.finish_reason is not None]
    assert sorted(c.index for c in last) == [0, 1, 2]
    assert all(c.finish_reason == "length" and c.usage is not None for c in last)
    assert all(c.usage.completion_tokens == 10 for c in last if c.usage is not None)
    wait_until(lambda: idle(system), 1.0, "blocks and ledger entry released")


def test_cancelled_n3_stream_releases_every_block(tiny_system: tuple[LocalSystem, str]) -> None:
    system, endpoint = tiny_system
    with Client(endpoint, timeout=60) as client:
        stream = client.generate(list(range(1, 120)), n=3, max_tokens=1500, ignore_eos=True)
        chunks = iter(stream)
        assert {next(chunks).index for _ in range(6)} == {0, 1, 2}
        assert sum(used_blocks(system).values()) > 0
        stream.cancel()
        wait_until(lambda: idle(system), 1.0, "every block released after cancel")
