"""A model whose generation_config lists several EOS ids (Llama-3 Instruct: end of text, of
message, of turn) stops at any of them with finish_reason "stop", masks all of them until
min_tokens, and ignores all of them with ignore_eos; config.json's EOS ids count too. A
single-EOS model keeps its one id. The disaggregated first-token check uses the same ids."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvmesh import LLM, SamplingParams
from kvmesh.engine import disagg
from kvmesh.engine.sequence import Request
from kvmesh.models.tiny import EOS_TOKEN_ID, build_tiny_model
from tests.checkpoints import with_generation_config

PROMPT = [(7 * i + 3) % 900 + 10 for i in range(12)]
NEW = 12
AT = 3  # the greedy output position whose token becomes an extra EOS id


@pytest.fixture(scope="module")
def plain(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("llama"), "llama", "test", seed=0)


@pytest.fixture(scope="module")
def reference(plain: Path) -> list[int]:
    """The single-EOS model's greedy output, EOS ignored."""
    llm = LLM(str(plain), num_kv_blocks=32)
    (out,) = llm.generate([PROMPT], greedy(ignore_eos=True))
    tokens = list(out.outputs[0].token_ids)
    assert EOS_TOKEN_ID not in tokens and tokens[AT] not in tokens[:AT]
    return tokens


def greedy(**fields: object) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=NEW, **fields)  # type: ignore[arg-type]


def with_eos(plain: Path, folder: Path, generation: object, config: object = None) -> LLM:
    """A copy of the tiny model whose generation_config.json (and config.json, when given)
    name `generation` (`config`) as eos_token_id."""
    with_generation_config(plain, folder, eos_token_id=generation)
    if config is not None:
        path = folder / "config.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), "eos_token_id": config}))
    return LLM(str(folder), num_kv_blocks=32)


def test_every_generation_config_eos_id_stops(
    plain: Path, reference: list[int], tmp_path: Path
) -> None:
    """The listed extra id ends the completion: "stop", no stop_reason, the token kept (as the
    model's one EOS id would be)."""
    extra = reference[AT]
    llm = with_eos(plain, tmp_path / "multi", [EOS_TOKEN_ID, 1000, extra])
    (out,) = llm.generate([PROMPT], greedy())
    completion = out.outputs[0]
    assert completion.token_ids == reference[: AT + 1]
    assert (completion.finish_reason, completion.stop_reason) == ("stop", None)
    assert llm.engine.parts.eos_token_ids == (EOS_TOKEN_ID, 1000, extra)
    assert llm.engine.parts.eos_token_id == EOS_TOKEN_ID  # ModelInfo's one id
    (ignored,) = llm.generate([PROMPT], greedy(ignore_eos=True))
    assert ignored.outputs[0].token_ids == reference
    assert ignored.outputs[0].finish_reason == "length"


def test_min_tokens_masks_every_eos_id(plain: Path, reference: list[int], tmp_path: Path) -> None:
    """Until min_tokens outputs no EOS id may be sampled, the extra ones included."""
    extra = reference[AT]
    llm = with_eos(plain, tmp_path / "multi", [EOS_TOKEN_ID, extra])
    (out,) = llm.generate([PROMPT], greedy(min_tokens=NEW))
    tokens = out.outputs[0].token_ids
    assert len(tokens) == NEW and out.outputs[0].finish_reason == "length"
    assert tokens[:AT] == reference[:AT] and tokens[AT] != extra
    assert not {EOS_TOKEN_ID, extra} & set(tokens)


def test_config_json_eos_ids_count_too(plain: Path, reference: list[int], tmp_path: Path) -> None:
    """config.json's ids join generation_config's (its own first), each once."""
    extra = reference[AT]
    llm = with_eos(plain, tmp_path / "both", EOS_TOKEN_ID, [extra, EOS_TOKEN_ID])
    (out,) = llm.generate([PROMPT], greedy())
    assert out.outputs[0].token_ids == reference[: AT + 1]
    assert llm.engine.parts.eos_token_ids == (EOS_TOKEN_ID, extra)


def test_single_eos_model_is_unchanged(plain: Path, reference: list[int]) -> None:
    llm = LLM(str(plain), num_kv_blocks=32)
    parts = llm.engine.parts
    assert (parts.eos_token_id, parts.eos_token_ids) == (EOS_TOKEN_ID, (EOS_TOKEN_ID,))
    assert llm.engine.scheduler.config.eos_token_ids == (EOS_TOKEN_ID,)
    (out,) = llm.generate([PROMPT], greedy())
    assert out.outputs[0].token_ids == reference


def test_first_token_check_of_an_import_knows_every_eos_id(
    plain: Path, reference: list[int], tmp_path: Path
) -> None:
    """A prefilled import whose first token is an extra EOS id needs no KV on the decode side;
    with ignore_eos, or min_tokens 2, it does."""
    extra = reference[AT]
    engine = with_eos(plain, tmp_path / "multi", [EOS_TOKEN_ID, extra]).engine

    def finishes(params: SamplingParams) -> bool:
        request = Request.from_prompt("probe", PROMPT, params)
        return disagg.first_tokens_finish(engine, request, [extra])

    assert finishes(greedy())
    assert not finishes(greedy(ignore_eos=True))
    assert not finishes(greedy(min_tokens=2))
