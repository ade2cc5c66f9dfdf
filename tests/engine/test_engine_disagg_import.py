"""Imports on the decode side (`disagg.reserve` then `import_prefilled`), on a real tiny model:
what an import publishes to the prefix cache is only KV that was written."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvmesh.engine import disagg
from kvmesh.engine.config import EngineConfig
from kvmesh.engine.engine import LLMEngine
from kvmesh.engine.sampling_params import SamplingParams
from kvmesh.engine.sequence import Request
from kvmesh.models.tiny import build_tiny_model

PROMPT = list(range(10, 58))  # three full blocks of 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("llama"), "llama", "test", seed=0)


def run(engine: LLMEngine, request_id: str, prompt: list[int]) -> list[int]:
    engine.add_request(request_id, prompt, GREEDY)
    tokens: list[int] = []
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id == request_id and out.finished:
                tokens = list(out.outputs[0].token_ids)
    return tokens


def test_an_import_without_kv_publishes_nothing_to_the_prefix_cache(checkpoint: Path) -> None:
    """A request whose first token ends it comes without KV (its blocks stay unwritten): its
    prompt's blocks must not be cached, or a later request with that prefix reads their
    stale bytes as its own KV and answers wrongly."""
    config = EngineConfig(model=str(checkpoint), num_kv_blocks=32, block_size=16)
    engine = LLMEngine(config)
    done = Request.from_prompt("done", PROMPT, SamplingParams(max_tokens=1))
    blocks = disagg.reserve(engine, done)
    assert blocks is not None
    out = disagg.import_prefilled(engine, done, [7], kv_complete=False)
    assert out.finished
    assert engine.scheduler.block_manager.metrics().cached_blocks == 0
    later = [*PROMPT, 3, 1, 4, 1, 5]
    assert run(engine, "later", later) == run(LLMEngine(config), "fresh", later)
    engine.scheduler.block_manager.check_integrity()
