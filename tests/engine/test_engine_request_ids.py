"""Request ids cannot name another request's parallel samples: an n > 1 request's children
are "<request_id>#<i>", and an id containing "#" is refused (InvalidParameterError naming
request_id) without touching the engine, whichever of the two requests came first."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvmesh import LLM, SamplingParams
from kvmesh.engine.engine import LLMEngine
from kvmesh.engine.errors import InvalidParameterError
from kvmesh.engine.outputs import RequestOutput
from kvmesh.models.tiny import build_tiny_model

NUM_BLOCKS = 64
PAIR = SamplingParams(n=2, temperature=1.0, seed=1, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("llama"), "llama", "test", seed=0)


def snapshot(engine: LLMEngine) -> tuple[object, ...]:
    """What a refused request must not change: the queues, the blocks, the open requests."""
    scheduler = engine.scheduler
    metrics = scheduler.block_manager.metrics()
    return scheduler.num_waiting, scheduler.num_running, metrics, engine.has_unfinished()


def refuse(engine: LLMEngine, request_id: str) -> None:
    """`request_id` is refused, naming the field, and the engine is unchanged."""
    before = snapshot(engine)
    with pytest.raises(InvalidParameterError) as refused:
        engine.add_request(request_id, list(range(40, 50)), SamplingParams(max_tokens=4))
    assert refused.value.field == "request_id"
    assert engine.scheduler.get_request(request_id) is None
    assert snapshot(engine) == before


def drain(engine: LLMEngine) -> dict[str, RequestOutput]:
    """Step until nothing is left; the final output of each request."""
    finished = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    return finished


def test_child_sequence_id_is_refused_as_a_request_id(checkpoint: Path) -> None:
    """With "a" (n = 2) forked into "a" and "a#1", a request "a#1" is refused; "a" ends
    with both its samples and every block comes back."""
    engine = LLM(str(checkpoint), num_kv_blocks=NUM_BLOCKS, num_threads=1).engine
    engine.add_request("a", list(range(10, 30)), PAIR)
    engine.step()  # the whole prompt: forked
    refuse(engine, "a#1")
    finished = drain(engine)
    assert list(finished) == ["a"]
    assert [len(c.token_ids) for c in finished["a"].outputs] == [6, 6]
    engine.scheduler.block_manager.check_integrity()
    assert engine.scheduler.block_manager.num_free_blocks == NUM_BLOCKS


def test_a_refused_id_leaves_the_later_fork_free(checkpoint: Path) -> None:
    """A request "a#1" refused before "a" (n = 2) exists: "a" then forks its own "a#1"."""
    engine = LLM(str(checkpoint), num_kv_blocks=NUM_BLOCKS, num_threads=1).engine
    refuse(engine, "a#1")
    assert not engine.has_unfinished()
    engine.add_request("a", list(range(10, 30)), PAIR)
    finished = drain(engine)
    assert [len(c.token_ids) for c in finished["a"].outputs] == [6, 6]
    assert engine.scheduler.block_manager.num_free_blocks == NUM_BLOCKS
