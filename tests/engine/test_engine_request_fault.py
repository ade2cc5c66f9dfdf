"""Fault isolation of one request in the step: a request whose post-processing raises (here its
tokenizer cannot decode a token id the model accepts) fails alone, with a clear error; the other
requests of the same steps finish with the output they have without it, no KV block is left
held, and the engine keeps serving.

The trigger is a real input on a real checkpoint: the tiny Llama (vocabulary 1024) with
transformers' ByT5Tokenizer (384 ids: 3 special, 256 bytes, 125 extra ids), a Python tokenizer
whose decode raises ValueError for any id beyond them, as any model whose embedding is padded
past its tokenizer's vocabulary admits. A prompt holding id 500 passes every check (it is in
the model's vocabulary) and raises in the detokenizer at the request's first token. The other
requests bias those ids away (logit_bias -100) so that their own tokens stay decodable.
"""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

import pytest

from kvmesh.engine.async_engine import AsyncLLMEngine
from kvmesh.engine.config import EngineConfig
from kvmesh.engine.engine import LLMEngine
from kvmesh.engine.errors import RequestFailedError
from kvmesh.engine.llm import LLM
from kvmesh.engine.sampling_params import SamplingParams
from tests.checkpoints import BYT5_TOKENIZER_IDS, byt5_checkpoint

UNDECODABLE = 500  # in the model's vocabulary (1024), beyond the tokenizer's
BIAS = {i: -100.0 for i in range(BYT5_TOKENIZER_IDS, 1024)}
GOOD = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logit_bias=BIAS)
GOOD_N = SamplingParams(temperature=0.8, seed=7, n=2, max_tokens=10, logit_bias=BIAS, logprobs=2)
GOOD_PROMPTS = {"a": list(range(40, 60)), "b": [72, 101, 108, 108, 111, 33, 32, 200]}
BAD_PROMPT = [72, 105, UNDECODABLE, 33]
BAD = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama with a ByT5Tokenizer (a Python tokenizer, no tokenizer.json)."""
    return byt5_checkpoint(tmp_path_factory.mktemp("llama-byt5"))


def config(checkpoint: Path) -> EngineConfig:
    return EngineConfig(model=str(checkpoint), device="cpu", num_kv_blocks=64)


def good_params(request_id: str) -> SamplingParams:
    return GOOD_N if request_id == "b" else GOOD


def texts(output: object) -> list[tuple[list[int], str, str | None]]:
    return [(list(o.token_ids), o.text, o.finish_reason) for o in output.outputs]  # type: ignore[attr-defined]


@pytest.fixture(scope="module")
def expected(checkpoint: Path) -> dict[str, list[tuple[list[int], str, str | None]]]:
    """The good requests' outputs without the faulty one."""
    engine = LLMEngine(config(checkpoint))
    assert type(engine.tokenizer).__name__ == "ByT5Tokenizer"
    for request_id, prompt in GOOD_PROMPTS.items():
        engine.add_request(request_id, prompt, good_params(request_id))
    finished = {}
    while engine.has_unfinished():
        finished.update({o.request_id: texts(o) for o in engine.step() if o.finished})
    for outs in finished.values():
        assert all(t < BYT5_TOKENIZER_IDS for ids, _, _ in outs for t in ids)
    return finished


def free_of(engine: LLMEngine) -> int:
    metrics = engine.scheduler.block_manager.metrics()
    return metrics.free_blocks + metrics.evictable_blocks


def test_a_request_failing_in_the_step_fails_alone(
    checkpoint: Path, expected: dict[str, list[tuple[list[int], str, str | None]]]
) -> None:
    engine = LLMEngine(config(checkpoint))
    total = engine.scheduler.block_manager.metrics().total_blocks
    engine.add_request("a", GOOD_PROMPTS["a"], GOOD)
    engine.step()  # "a" is decoding when the faulty request joins
    engine.add_request("bad", BAD_PROMPT, BAD)
    engine.add_request("b", GOOD_PROMPTS["b"], GOOD_N)
    finished = {}
    while engine.has_unfinished():
        finished.update({o.request_id: o for o in engine.step() if o.finished})
    bad = finished.pop("bad")
    assert isinstance(bad.error, RequestFailedError)
    assert "'bad'" in str(bad.error) and "ValueError" in str(bad.error)
    assert all(o.finish_reason == "error" for o in bad.outputs)
    assert {k: texts(o) for k, o in finished.items()} == expected
    assert all(o.error is None for o in finished.values())
    assert free_of(engine) == total  # nothing held: the failed request's blocks came back
    assert not engine.scheduler.has_unfinished()


def test_llm_generate_returns_the_failure_and_keeps_serving(
    checkpoint: Path, expected: dict[str, list[tuple[list[int], str, str | None]]]
) -> None:
    llm = LLM(str(checkpoint), device="cpu", num_kv_blocks=64)
    good, bad = llm.generate([GOOD_PROMPTS["a"], BAD_PROMPT], [GOOD, BAD])
    assert texts(good) == expected["a"] and good.error is None
    assert isinstance(bad.error, RequestFailedError) and bad.outputs[0].finish_reason == "error"
    total = llm.engine.scheduler.block_manager.metrics().total_blocks
    assert free_of(llm.engine) == total and not llm.engine.has_unfinished()
    # (no logprobs: LLM.generate decodes their top ids, which here include undecodable ones)
    plain = dataclasses.replace(GOOD_N, logprobs=None)
    outs = llm.generate(list(GOOD_PROMPTS.values()), [GOOD, plain])
    assert [texts(o) for o in outs] == [expected["a"], expected["b"]]


def test_the_step_loop_survives_and_other_streams_finish(
    checkpoint: Path, expected: dict[str, list[tuple[list[int], str, str | None]]]
) -> None:
    async def scenario() -> None:
        engine = AsyncLLMEngine(config(checkpoint), output_timeout=60.0)
        try:

            async def collect(request_id: str, prompt: list[int], params: SamplingParams) -> object:
                last = None
                async for output in engine.generate(request_id, prompt, params):
                    last = output
                return texts(last)

            results = await asyncio.gather(
                *(collect(rid, p, good_params(rid)) for rid, p in GOOD_PROMPTS.items()),
                collect("bad", BAD_PROMPT, BAD),
                return_exceptions=True,
            )
            assert dict(zip(GOOD_PROMPTS, results[:2], strict=True)) == expected
            error = results[2]
            assert isinstance(error, RequestFailedError), error
            assert error.status_name == "INTERNAL" and "'bad'" in str(error)
            assert engine.error is None
            load = engine.load()
            assert load.free_blocks == load.total_blocks
            assert load.running == load.waiting == 0
            assert engine.num_unfinished == 0
            # the engine still serves
            again = await collect("a2", GOOD_PROMPTS["a"], GOOD)
            assert again == expected["a"]
        finally:
            await engine.shutdown()

    asyncio.run(scenario())
