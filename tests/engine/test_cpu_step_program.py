"""CPU steps replayed as one recorded program of the kernels' calls (`decode_program`).

The program makes the eager forward's kernel calls with the same arguments, so its steps must
give the eager steps' results bit for bit: the same greedy tokens and the same logprobs, for
every architecture it covers, float32 and bfloat16, a quantized cache, a sliding window, after
the cache moves, for decode steps and for mixed steps (prompt chunks with cached context
beside decodes); where it does not cover a model or a step it says why and the eager path
runs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from kvmesh_kernels import cpu_program, dispatch

from kvmesh import LLM, SamplingParams
from kvmesh.engine.native import step_program
from kvmesh.models.tiny import build_tiny_model
from tests.engine.test_native_executor import PROMPT, hf_greedy

PROMPTS = [PROMPT, PROMPT[:40], PROMPT[:17], PROMPT[5:70]]
SAMPLING = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=3)


def run(llm: LLM) -> list[tuple[list[int], list[Any]]]:
    """Greedy tokens and their logprobs (top 3 each) of every prompt."""
    outputs = llm.generate(PROMPTS, SAMPLING)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outputs]


def eager_then_program(checkpoint: Path, **engine: Any) -> tuple[LLM, list, list]:
    """The prompts run eagerly, then with the program enabled on the same engine."""
    llm = LLM(
        str(checkpoint), num_kv_blocks=96, max_num_seqs=8, decode_program=False,
        enable_prefix_caching=False, **engine,
    )  # fmt: skip
    eager = run(llm)
    runner = llm.engine.runner
    assert runner.enable_decode_program(max_num_seqs=8) is None
    replayed = run(llm)
    program = runner.decode_program
    assert program is not None and program.replays >= SAMPLING.max_tokens - 1
    return llm, eager, replayed


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_program_steps_equal_eager_steps_bit_for_bit(tmp_path: Path, arch: str, dtype: str) -> None:
    checkpoint = build_tiny_model(tmp_path / arch, arch, "test", seed=0)
    _, eager, replayed = eager_then_program(checkpoint, dtype=dtype)
    assert replayed == eager  # tokens, and logprobs compared as floats: bit for bit
    if dtype == "float32":
        assert replayed[0][0] == hf_greedy(checkpoint, PROMPT, SAMPLING.max_tokens)


def test_program_steps_write_and_read_a_quantized_cache_as_eager_steps(tmp_path: Path) -> None:
    checkpoint = build_tiny_model(tmp_path / "llama", "llama", "test", seed=0)
    _, eager, replayed = eager_then_program(checkpoint, dtype="float32", kv_dtype="int8")
    assert replayed == eager


def test_the_program_follows_a_moved_kv_cache(tmp_path: Path) -> None:
    """A decode worker moves its cache into registered shared memory after load: the recorded
    calls must read and write the new cache (tokens differ from the eager steps otherwise)."""
    checkpoint = build_tiny_model(tmp_path / "llama", "llama", "test", seed=0)
    llm, eager, _ = eager_then_program(checkpoint, dtype="float32")
    runner = llm.engine.runner
    moved = torch.zeros_like(runner.kv_cache.data)
    llm.engine.move_kv_cache(moved, None)
    program = runner.decode_program
    assert program is not None and program.cache.data.data_ptr() == moved.data_ptr()
    assert run(llm) == eager and program.replays >= SAMPLING.max_tokens - 1


def test_a_cache_moved_where_the_program_cannot_run_drops_the_program(tmp_path: Path) -> None:
    """Re-recorded after a move under another kernel backend, the program cannot run: the
    runner keeps none (not the old one, which held the old cache) and steps run eagerly."""
    checkpoint = build_tiny_model(tmp_path / "llama", "llama", "test", seed=0)
    llm, eager, _ = eager_then_program(checkpoint, dtype="float32")
    dispatch.set_backend("reference")
    try:
        llm.engine.move_kv_cache(torch.zeros_like(llm.engine.runner.kv_cache.data), None)
    finally:
        dispatch.set_backend(None)
    assert llm.engine.runner.decode_program is None
    assert run(llm) == eager


def test_the_program_is_on_by_default_and_names_what_it_does_not_cover(tmp_path: Path) -> None:
    llama = build_tiny_model(tmp_path / "llama", "llama", "test", seed=0)
    llm = LLM(str(llama), num_kv_blocks=96, max_num_seqs=8, dtype="float32")
    assert llm.engine.runner.decode_program is not None
    qwen3 = build_tiny_model(tmp_path / "qwen3", "qwen3", "test", seed=0)
    llm = LLM(str(qwen3), num_kv_blocks=96, max_num_seqs=8, dtype="float32")
    assert llm.engine.runner.decode_program is not None  # per-head q/k norms recorded too
    llm = LLM(str(qwen3), num_kv_blocks=96, max_num_seqs=8, dtype="float32", cpu_gemm="torch")
    runner = llm.engine.runner
    assert runner.decode_program is None
    reason = step_program.why_not(runner.loaded.model, runner.kv_cache)
    assert reason == "layer 0: a linear not on kvmesh's GEMM"
    llm = LLM(str(llama), num_kv_blocks=96, max_num_seqs=8, executor="transformers")
    runner = llm.engine.runner
    assert runner.decode_program is None
    assert step_program.why_not(runner.loaded.model, runner.kv_cache) == "not the native executor"


def test_steps_beyond_the_program_run_eagerly(tmp_path: Path) -> None:
    """Decode steps of more sequences than the program's rows take the eager forward."""
    checkpoint = build_tiny_model(tmp_path / "llama", "llama", "test", seed=0)
    llm = LLM(
        str(checkpoint), num_kv_blocks=96, max_num_seqs=8, decode_program=False,
        enable_prefix_caching=False,
    )  # fmt: skip
    eager = run(llm)
    runner = llm.engine.runner
    assert runner.enable_decode_program(max_num_seqs=2) is None  # 4 prompts: 4 rows > 2
    assert run(llm) == eager
    program = runner.decode_program
    assert program is not None and program.replays == 0
    pair = llm.generate(PROMPTS[:2], SAMPLING)
    assert [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in pair] == eager[:2]
    assert program.replays >= SAMPLING.max_tokens - 1


def test_under_another_kernel_backend_decode_steps_run_eagerly(tmp_path: Path) -> None:
    """With the torch reference chosen for attention and KV writes (`set_backend`, or
    KVMESH_KERNEL_BACKEND), the eager step does not run the fused kernels, so the program
    neither starts nor replays a step planned under it."""
    checkpoint = build_tiny_model(tmp_path / "llama", "llama", "test", seed=0)
    llm, eager, _ = eager_then_program(checkpoint, dtype="float32")
    program = llm.engine.runner.decode_program
    assert program is not None
    replays = program.replays
    dispatch.set_backend("reference")
    try:
        reference = run(llm)
        assert program.replays == replays  # every step took the reference path
        fresh = LLM(str(checkpoint), num_kv_blocks=96, max_num_seqs=8, dtype="float32")
        runner = fresh.engine.runner
        assert runner.decode_program is None
        reason = step_program.why_not(runner.loaded.model, runner.kv_cache)
        assert reason is not None and "reference" in reason
    finally:
        dispatch.set_backend(None)
    assert [tokens for tokens, _ in reference] == [tokens for tokens, _ in eager]


SHARED = PROMPT[:48]  # three full 16-token blocks every later prompt finds in the cache
ARRIVALS = [SHARED + PROMPT[60 + i : 60 + i + 5 + 3 * i] for i in range(5)]


def staggered(llm: LLM, steps_between: int = 3) -> list[tuple[list[int], Any]]:
    """The ARRIVALS added one by one, `steps_between` steps apart, so each later prompt's
    chunks (after its cached prefix) share steps with the earlier ones' decodes; tokens and
    logprobs of each, in arrival order."""
    engine, done = llm.engine, dict[str, Any]()

    def step() -> None:
        for output in engine.step():
            if output.finished:
                done[output.request_id] = output.outputs[0]

    for i, prompt in enumerate(ARRIVALS):
        engine.add_request(f"r{i}", prompt, SAMPLING)
        for _ in range(steps_between):
            step()
    while engine.has_unfinished():
        step()
    return [(done[f"r{i}"].token_ids, done[f"r{i}"].logprobs) for i in range(len(ARRIVALS))]


def replayed_shapes(llm: LLM) -> list[tuple[int, int]]:
    """Observe the (token rows, sequences) of every step the program replays from now on."""
    program = llm.engine.runner.decode_program
    assert program is not None
    shapes, forward = list[tuple[int, int]](), program.forward

    def observed(input_ids: torch.Tensor, positions: torch.Tensor, ctx: Any) -> torch.Tensor:
        shapes.append((int(input_ids.shape[0]), ctx.num_seqs))
        return forward(input_ids, positions, ctx)

    program.forward = observed  # type: ignore[method-assign]
    return shapes


@pytest.mark.parametrize("arch", ["llama", "mistral"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_mixed_steps_with_cached_prefixes_equal_eager_steps(
    tmp_path: Path, arch: str, dtype: str
) -> None:
    """Prompts sharing a cached prefix arrive while earlier ones decode, in 24-token chunks:
    their steps mix chunks that attend to cached context with decodes, and the program's
    replays of them give the eager steps' tokens and logprobs bit for bit."""
    checkpoint = build_tiny_model(tmp_path / arch, arch, "test", seed=0)
    engine = dict(
        num_kv_blocks=96, max_num_seqs=8, max_num_batched_tokens=24, dtype=dtype,
        fresh_attention="on",
    )  # fmt: skip
    eager = staggered(LLM(str(checkpoint), decode_program=False, **engine))
    llm = LLM(str(checkpoint), **engine)
    shapes = replayed_shapes(llm)
    assert staggered(llm) == eager
    mixed = [(rows, seqs) for rows, seqs in shapes if rows > seqs]
    assert len(mixed) >= 3 and any(seqs > 1 for _, seqs in mixed), shapes
    if dtype == "float32":
        assert eager[0][0] == hf_greedy(checkpoint, ARRIVALS[0], SAMPLING.max_tokens)


def test_prompt_steps_replay_where_first_chunks_attend_through_the_cache(
    tmp_path: Path,
) -> None:
    """With first chunks on the paged kernel (`fresh_attention=off`) every step up to the
    program's token rows replays, a prompt-only step too; a larger step runs eagerly."""
    checkpoint = build_tiny_model(tmp_path / "llama", "llama", "test", seed=0)
    engine = dict(num_kv_blocks=96, max_num_seqs=8, dtype="float32", fresh_attention="off")
    eager_llm = LLM(str(checkpoint), decode_program=False, **engine)
    eager = staggered(eager_llm)
    llm = LLM(str(checkpoint), **engine)
    runner = llm.engine.runner
    assert runner.enable_decode_program(max_num_seqs=8, max_num_batched_tokens=60) is None
    shapes = replayed_shapes(llm)
    assert staggered(llm) == eager
    assert (len(ARRIVALS[0]), 1) in shapes  # the first prompt alone, whole
    long = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=3)
    alone = llm.generate([PROMPT], long)[0].outputs[0]
    assert (len(PROMPT), 1) not in shapes and all(rows <= 60 for rows, _ in shapes)
    expected = eager_llm.generate([PROMPT], long)[0].outputs[0]
    assert (alone.token_ids, alone.logprobs) == (expected.token_ids, expected.logprobs)


def test_a_failing_op_is_named_by_its_index_and_code() -> None:
    program = cpu_program.Program(torch.float32, threads=1)
    x, w, y = torch.ones(2, 16), torch.ones(16), torch.zeros(2, 16)
    program.rms_norm(x, w, y, 1e-6)
    program._ops.append([77] + [0] * (cpu_program.SLOTS - 1))  # a kind the runner lacks
    with pytest.raises(RuntimeError, match=r"op 1 \(kind 77\) failed with code 999"):
        program.run(2, 2)
    assert torch.allclose(y, torch.ones(2, 16), atol=1e-5)  # op 0 ran first
