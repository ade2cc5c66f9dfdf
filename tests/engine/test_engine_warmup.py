"""Warm-up before serving: kernels loaded, one step run, no engine state changed."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvmesh.engine.config import EngineConfig
from kvmesh.engine.engine import LLMEngine
from kvmesh.engine.sampling_params import SamplingParams
from kvmesh.engine.warmup import WARMUP_ENV, warm_up
from kvmesh.models.tiny import build_tiny_model

PROMPTS = [[5, 9, 2, 7, 1, 3], list(range(3, 30))]


def greedy(engine: LLMEngine) -> list[list[int]]:
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"r{i}", prompt, params)
    done: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = list(out.outputs[0].token_ids)
    return [done[f"r{i}"] for i in range(len(PROMPTS))]


def test_warm_up_runs_a_step_and_leaves_no_trace(tmp_path: Path) -> None:
    model = str(build_tiny_model(tmp_path, "llama", "test", seed=0))
    config = EngineConfig(model=model, block_size=4, num_kv_blocks=32)  # warm-up spans 2 blocks
    warmed = LLMEngine(config)
    before = warmed.scheduler.block_manager.metrics()
    report = warm_up(warmed, "full")
    assert report.mode == "full" and report.kernels in ("loaded", "disabled")
    assert report.step_seconds > 0
    assert warmed.scheduler.block_manager.metrics() == before
    assert greedy(warmed) == greedy(LLMEngine(config))  # same tokens as a cold engine
    warmed.scheduler.block_manager.check_integrity()


def test_warm_up_mode_from_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    engine = LLMEngine(EngineConfig(model=str(build_tiny_model(tmp_path, "llama", "test"))))
    monkeypatch.setenv(WARMUP_ENV, "off")
    assert warm_up(engine).as_dict() == {
        "mode": "off", "kernels": "not loaded", "kernel_seconds": 0.0, "step_seconds": 0.0,
    }  # fmt: skip
    monkeypatch.setenv(WARMUP_ENV, "later")
    with pytest.raises(ValueError, match="KVMESH_WARMUP='later': must be one of full"):
        warm_up(engine)


@pytest.mark.parametrize(("max_model_len", "block_size"), [(6, 2), (4, 1), (1, 4)])
def test_warm_up_stays_within_max_model_len(
    tmp_path: Path, max_model_len: int, block_size: int
) -> None:
    """An engine whose sequences are shorter than the warm-up's 8 tokens (its block tables, or
    the model's positions, end sooner) still warms up, then serves what fits."""
    model = str(build_tiny_model(tmp_path, "llama", "test", seed=0))
    config = EngineConfig(
        model=model, max_model_len=max_model_len, block_size=block_size, num_kv_blocks=64
    )
    engine = LLMEngine(config)
    warm_up(engine, "full")
    if max_model_len > 1:  # a one-token prompt and the rest of the room
        params = SamplingParams(max_tokens=max_model_len - 1, temperature=0.0, ignore_eos=True)
        engine.add_request("fits", [5], params)
        while engine.has_unfinished():
            engine.step()
    engine.scheduler.block_manager.check_integrity()
