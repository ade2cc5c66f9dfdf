"""Shared by the system tests: one disaggregated system (1 prefill + 1 decode, shared memory),
the offline engine on the same tiny test model, for greedy parity, and a tiny model with a chat
template."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from sys_harness import GREEDY, local_system

from kvmesh.cli.up import LocalSystem


@pytest.fixture(scope="session")
def shm_system() -> Iterator[tuple[LocalSystem, str]]:
    with local_system(transfer_backend="shm") as started:
        yield started


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The tiny test checkpoint (random weights, byte tokenizer, a simple chat template)."""
    from kvmesh.models.tiny import build_tiny_model
    from kvmesh.models.tokenizer import set_chat_template

    folder: Path = tmp_path_factory.mktemp("tiny-llama")
    build_tiny_model(folder, "llama", "test", 0)
    set_chat_template(folder)
    return str(folder)


@pytest.fixture(scope="session")
def offline() -> Callable[[list[Any]], list[list[int]]]:
    """Greedy token ids (GREEDY sampling) of the offline engine for each prompt."""
    from kvmesh import LLM, SamplingParams
    from kvmesh.models.tiny import tiny_model_path

    llm = LLM(model=str(tiny_model_path()))
    params = SamplingParams(**GREEDY)

    def run(prompts: list[Any]) -> list[list[int]]:
        return [list(out.outputs[0].token_ids) for out in llm.generate(prompts, params)]

    return run
