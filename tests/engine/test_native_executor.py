"""The native executor: chosen for the Llama family, equal to transformers where it runs.

Greedy token identity with transformers' `generate` over whole engines is covered for every
architecture by test_engine_runner.py and test_engine_llm.py (the default executor is native);
here: the choice itself, logits against transformers' forward, rope scaling types, fallbacks,
and bfloat16 against float32.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from kvmesh_kernels import cpu_build, cpu_fused

from kvmesh import LLM, SamplingParams
from kvmesh.engine.config import EngineConfig
from kvmesh.engine.errors import UnsupportedModelError
from kvmesh.engine.loader import load_model
from kvmesh.engine.native.layers import FUSED_SILU_MIN_OUTPUTS, silu_and_mul
from kvmesh.engine.native.llama import NativeCausalLM
from kvmesh.engine.native.rope import RotaryTable, apply_rotary
from kvmesh.engine.runner import ModelRunner
from kvmesh.engine.scheduler.plan import NewSeq, ScheduledChunk, plan_of_chunks
from kvmesh.models.tiny import build_tiny_model

ARCHS = ("llama", "qwen2", "qwen3", "mistral")
PROMPT = [(7 * i + 3) % 1000 + 10 for i in range(90)]  # crosses the test-size window (64)
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module", params=ARCHS)
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp(request.param), request.param, "test", seed=0)


def with_config(path: Path, out: Path, **changes: Any) -> Path:
    """A copy of checkpoint `path` in `out` with config.json fields changed."""
    out.mkdir(parents=True, exist_ok=True)
    for item in path.iterdir():
        if item.name != "config.json":
            (out / item.name).symlink_to(item)
    config = json.loads((path / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, **changes}))
    return out


def hf_last_logits(path: Path, prompt: list[int], dtype: torch.dtype) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model: Any = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)
    with torch.inference_mode():
        return model(torch.tensor([prompt])).logits[0, -1].float()  # [vocab]


def hf_greedy(path: Path, prompt: list[int], new_tokens: int) -> list[int]:
    from transformers import AutoModelForCausalLM

    model: Any = AutoModelForCausalLM.from_pretrained(str(path), attn_implementation="sdpa")
    out = model.generate(
        torch.tensor([prompt]),
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        pad_token_id=0,
    )
    return list(out[0, len(prompt) :].tolist())


def runner_logits(loaded: Any, prompt: list[int]) -> torch.Tensor:
    """A fresh runner's logits over `loaded` for the last prompt token (one prefill chunk)."""
    runner = ModelRunner(loaded, 64, 4, "auto")
    table = tuple(range(-(-len(prompt) // 4)))
    chunk = ScheduledChunk("0", tuple(prompt), 0, table, (), ("0",))
    plan = plan_of_chunks((chunk,), block_size=4, new_seqs=(NewSeq("0", table),))
    return runner.execute(plan)[0]  # [vocab] in the model dtype


def native_last_logits(
    path: Path, prompt: list[int], dtype: str, fresh_attention: str = "auto", gemm: str = "auto"
) -> torch.Tensor:
    """The native runner's logits for the last prompt token (one prefill chunk)."""
    config = EngineConfig(model=str(path), dtype=dtype, executor="native", cpu_gemm=gemm)
    loaded = load_model(config)
    runner = ModelRunner(loaded, 64, 4, "auto", fresh_attention=fresh_attention)
    table = tuple(range(-(-len(prompt) // 4)))
    chunk = ScheduledChunk("0", tuple(prompt), 0, table, (), ("0",))
    plan = plan_of_chunks((chunk,), block_size=4, new_seqs=(NewSeq("0", table),))
    return runner.execute(plan)[0].float()  # [vocab], widened from the model dtype


def test_auto_picks_native_and_transformers_on_request(checkpoint: Path) -> None:
    auto = load_model(EngineConfig(model=str(checkpoint)))
    assert auto.executor == "native" and isinstance(auto.model, NativeCausalLM)
    hf = load_model(EngineConfig(model=str(checkpoint), executor="transformers"))
    assert hf.executor == "transformers" and not isinstance(hf.model, NativeCausalLM)


@pytest.mark.parametrize("gemm", ["auto", "torch"])
def test_float32_logits_match_transformers_forward(checkpoint: Path, gemm: str) -> None:
    """kvmesh's float32 GEMM (auto, on AVX-512 CPUs) or torch's: transformers' logits."""
    expected = hf_last_logits(checkpoint, PROMPT, torch.float32)
    got = native_last_logits(checkpoint, PROMPT, "float32", gemm=gemm)
    assert torch.allclose(got, expected, atol=1e-4, rtol=1e-4), (got - expected).abs().max()


@pytest.mark.parametrize(
    "fresh_attention,gemm", [("on", "auto"), ("off", "auto"), ("off", "torch")]
)
def test_bfloat16_within_tolerance_of_float32(
    checkpoint: Path, fresh_attention: str, gemm: str
) -> None:
    """Stated tolerance: the native bfloat16 logits are no further from the float32 ones than
    transformers' own bfloat16 forward is (mean and max absolute error, within 1.5x), whichever
    path attends the first chunk (causal sdpa on its own K/V, or the paged kernel) and whichever
    GEMM runs the linears (kvmesh's where the CPU has AVX512_BF16, or oneDNN's: torch)."""
    reference = hf_last_logits(checkpoint, PROMPT, torch.float32)
    hf_error = (hf_last_logits(checkpoint, PROMPT, torch.bfloat16) - reference).abs()
    native = native_last_logits(checkpoint, PROMPT, "bfloat16", fresh_attention, gemm)
    error = (native - reference).abs()
    assert error.mean() <= 1.5 * hf_error.mean(), (error.mean(), hf_error.mean())
    assert error.max() <= 1.5 * hf_error.max(), (error.max(), hf_error.max())


ROPE_SCALINGS = {
    "linear": {"rope_type": "linear", "factor": 2.0},
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    },
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512},
}


@pytest.mark.parametrize("kind", sorted(ROPE_SCALINGS))
def test_rope_scaling_types_match_transformers(tmp_path: Path, kind: str) -> None:
    base = build_tiny_model(tmp_path / "base", "llama", "test", seed=0)
    rope = {"rope_theta": 10000.0, **ROPE_SCALINGS[kind]}
    path = with_config(base, tmp_path / kind, rope_parameters=rope)
    llm = LLM(str(path), num_kv_blocks=64, executor="native")
    (output,) = llm.generate([PROMPT], GREEDY)
    assert output.outputs[0].token_ids == hf_greedy(path, PROMPT, GREEDY.max_tokens)


def test_dynamic_rope_falls_back_or_fails_clearly(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    base = build_tiny_model(tmp_path / "base", "llama", "test", seed=0)
    rope = {"rope_theta": 10000.0, "rope_type": "dynamic", "factor": 2.0}
    path = with_config(base, tmp_path / "dynamic", rope_parameters=rope)
    with caplog.at_level(logging.INFO, logger="kvmesh.engine.executor"):
        assert load_model(EngineConfig(model=str(path))).executor == "transformers"
    assert "rope_type 'dynamic'" in caplog.text
    with pytest.raises(UnsupportedModelError, match="rope_type 'dynamic'"):
        load_model(EngineConfig(model=str(path), executor="native"))


def test_other_activation_keeps_transformers(tmp_path: Path) -> None:
    base = build_tiny_model(tmp_path / "base", "llama", "test", seed=0)
    path = with_config(base, tmp_path / "gelu", hidden_act="gelu")
    loaded = load_model(EngineConfig(model=str(path)))
    assert loaded.executor == "transformers"
    llm = LLM(str(path), num_kv_blocks=64)
    (output,) = llm.generate([PROMPT], GREEDY)
    assert output.outputs[0].token_ids == hf_greedy(path, PROMPT, GREEDY.max_tokens)


@pytest.mark.parametrize("fresh_attention", ["on", "off"])
def test_both_first_chunk_paths_keep_greedy_parity(checkpoint: Path, fresh_attention: str) -> None:
    """Prompts attended by causal sdpa (on) or by the paged kernel (off) both give
    transformers' greedy tokens in float32; the runner holds the forced rule."""
    llm = LLM(str(checkpoint), num_kv_blocks=64, dtype="float32", fresh_attention=fresh_attention)
    rule = llm.engine.runner.fresh_rule
    assert rule.pays((0, 1)) == (fresh_attention == "on")
    (output,) = llm.generate([PROMPT], GREEDY)
    assert output.outputs[0].token_ids == hf_greedy(checkpoint, PROMPT, GREEDY.max_tokens)


@pytest.mark.parametrize("gemm", ["auto", "torch"])
def test_bfloat16_native_packs_merged_linears(checkpoint: Path, gemm: str) -> None:
    """Every linear is packed once at load: for kvmesh's GEMM where the CPU has AVX512_BF16
    (unless torch's is asked for), else for oneDNN's."""
    from kvmesh_kernels import cpu_gemm

    from kvmesh.engine.cpu_linear import CpuGemmLinear, PackedLinear, packing_applies

    if not packing_applies(torch.bfloat16, torch.device("cpu")):
        pytest.skip("no native bfloat16 matmul on this CPU")
    config = EngineConfig(model=str(checkpoint), dtype="bfloat16", executor="native", cpu_gemm=gemm)
    loaded = load_model(config)
    packed = [m for m in loaded.model.modules() if isinstance(m, PackedLinear)]
    assert len(packed) == 4 * loaded.hf_config.num_hidden_layers + 1  # qkv, o, gate_up, down; head
    ours = gemm == "auto" and cpu_gemm.gemm_supported(torch.bfloat16)
    assert all(isinstance(m, CpuGemmLinear) == ours for m in packed)


def test_float32_packed_linears_keep_greedy_parity(checkpoint: Path) -> None:
    """float32_packing="on" (oneDNN-packed float32 linears, chosen at load where they measure
    faster, when kvmesh's GEMM is not used) still gives transformers' greedy tokens."""
    from kvmesh.engine.cpu_linear import PackedLinear

    if not torch.backends.mkldnn.is_available():
        pytest.skip("no oneDNN in this torch build")
    llm = LLM(
        str(checkpoint), num_kv_blocks=64, dtype="float32", float32_packing="on", cpu_gemm="torch"
    )
    model = llm.engine.runner.loaded.model
    assert any(type(m) is PackedLinear for m in model.modules())
    (output,) = llm.generate([PROMPT], GREEDY)
    assert output.outputs[0].token_ids == hf_greedy(checkpoint, PROMPT, GREEDY.max_tokens)


def test_silu_and_mul_takes_the_fused_kernel_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """float32 and bfloat16 [T, 2I] of FUSED_SILU_MIN_OUTPUTS outputs go to the fused kernel
    (when built); float16, 3-D and smaller inputs keep torch's two ops; every result equals
    torch's formula to its dtype."""
    fused: list[torch.dtype] = []
    real = cpu_fused.silu_mul

    def spy(gate_up: torch.Tensor) -> torch.Tensor:
        fused.append(gate_up.dtype)
        return real(gate_up)

    monkeypatch.setattr(cpu_fused, "silu_mul", spy)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        smallest = (16, 2 * FUSED_SILU_MIN_OUTPUTS // 16)  # [T, 2I] of the threshold's outputs
        for shape in (smallest, (5, 26), (2, *smallest)):
            gate_up = torch.randn(shape, generator=torch.Generator().manual_seed(1)).to(dtype)
            gate, up = gate_up.chunk(2, dim=-1)
            expected = F.silu(gate) * up
            got = silu_and_mul(gate_up)
            assert got.dtype == dtype and got.shape == expected.shape
            assert torch.allclose(got.float(), expected.float(), rtol=1e-6, atol=0)
    assert FUSED_SILU_MIN_OUTPUTS == 16 * 1024  # the first shape is the smallest fused one
    assert fused == ([torch.float32, torch.bfloat16] if cpu_build.available() else [])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gate_up_applies_silu_in_the_gemm_where_kvmeshs_gemm_runs(
    checkpoint: Path, dtype: str
) -> None:
    """With kvmesh's GEMM every layer's gate|up linear carries SiLU-and-mul in its epilogue
    (output [T, I]) and the model's logits equal the same model on the plain gate|up GEMM
    followed by the SiLU-and-mul kernel, bit for bit; torch's GEMM keeps gate|up [T, 2I]."""
    from kvmesh_kernels import cpu_gemm
    from transformers import AutoModelForCausalLM

    from kvmesh.engine.cpu_linear import CpuGemmGateUpSilu, CpuGemmLinear

    if not cpu_gemm.gemm_supported(getattr(torch, dtype)):
        pytest.skip(f"no {dtype} GEMM of kvmesh's on this CPU")
    config = EngineConfig(model=str(checkpoint), dtype=dtype, executor="native", cpu_gemm="kvmesh")
    loaded = load_model(config)
    model: Any = loaded.model
    assert all(isinstance(layer.gate_up, CpuGemmGateUpSilu) for layer in model.layers)
    assert all(layer.gate_up_activates for layer in model.layers)
    rows_outputs = len(PROMPT) * model.layers[0].gate_up.out_features  # T * I
    assert rows_outputs >= FUSED_SILU_MIN_OUTPUTS  # so the unfused path takes the kernel
    fused = runner_logits(loaded, PROMPT)
    hf: Any = AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=getattr(torch, dtype))
    for layer, hf_layer in zip(model.layers, hf.model.layers, strict=True):
        mlp = hf_layer.mlp  # the same weights, unfused: plain GEMM, then the SiLU kernel
        weight = torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]).detach()  # [2I, in]
        layer.gate_up = CpuGemmLinear.from_weight(weight, None)
        layer.call_linears_directly(True)
    assert torch.equal(runner_logits(loaded, PROMPT), fused)
    torch_gemm = EngineConfig(
        model=str(checkpoint), dtype=dtype, executor="native", cpu_gemm="torch"
    )
    plain = load_model(torch_gemm).model
    assert not any(layer.gate_up_activates for layer in plain.layers)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_of_adjacent_q_and_k_is_one_call_and_equals_two(
    dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """q and k split from one q|k|v output are rotated by one kernel call over both (when the
    fused kernel is built), bit for bit as q and k rotated apart; apart ones take two calls."""
    if not cpu_build.available():
        pytest.skip("fused CPU kernels not built")
    heads, kv_heads, dim, tokens = 9, 3, 64, 5
    rotary = SimpleNamespace(inv_freq=1.0 / 10000 ** (torch.arange(0, dim, 2) / dim))
    table = RotaryTable(rotary, 64, dtype, torch.device("cpu"))
    positions = torch.tensor([0, 3, 17, 40, 63])
    generator = torch.Generator().manual_seed(0)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=generator).to(dtype)
    q, k, _ = qkv.split((heads * dim, kv_heads * dim, kv_heads * dim), dim=-1)
    q, k = q.view(tokens, heads, dim), k.view(tokens, kv_heads, dim)
    q_apart, k_apart = q.clone(), k.clone()
    cos, sin = table.cos[positions].unsqueeze(1), table.sin[positions].unsqueeze(1)  # [T, 1, D]
    expected = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)  # torch's arithmetic
    calls: list[int] = []
    real = cpu_fused.rope_

    def spy(x: torch.Tensor, *args: torch.Tensor) -> None:
        calls.append(x.shape[1])
        real(x, *args)

    monkeypatch.setattr(cpu_fused, "rope_", spy)
    step = table.at(positions)
    step.apply(q, k)
    assert calls == [heads + kv_heads]
    step.apply(q_apart, k_apart)
    assert calls == [heads + kv_heads, heads, kv_heads]
    assert torch.equal(q, q_apart) and torch.equal(k, k_apart)
    assert torch.equal(q, expected[0]) and torch.equal(k, expected[1])


def test_linear_kind_follows_cpu_gemm_and_the_cpu(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """auto takes kvmesh's GEMM where the CPU runs it, except bfloat16 on an AMX CPU where
    kvmesh's own AMX path does not run; kvmesh where the CPU cannot run it warns and falls
    back; torch follows float32_packing in float32."""
    from types import SimpleNamespace

    from kvmesh.engine import loader

    cpu = torch.device("cpu")
    hf = SimpleNamespace(hidden_size=64, intermediate_size=128, num_attention_heads=4)

    def kind(
        gemm: str,
        dtype: torch.dtype,
        runs: bool,
        amx: bool,
        packing: str = "off",
        path: str = "avx512",
    ) -> str:
        monkeypatch.setattr(loader, "kvmesh_gemm_applies", lambda d, dev: runs)
        monkeypatch.setattr(loader, "has_amx", lambda: amx)
        monkeypatch.setattr(loader, "kvmesh_gemm_path", lambda d, k=None: path)
        config = EngineConfig(cpu_gemm=gemm, float32_packing=packing)
        return loader.native_linears(config, hf, dtype, cpu)

    assert kind("auto", torch.float32, runs=True, amx=False) == "kvmesh"
    assert kind("auto", torch.float32, runs=True, amx=True) == "kvmesh"  # AMX has no float32
    # oneDNN's AMX wins (packed where oneDNN runs bfloat16 natively, as on every AMX CPU)
    onednn = "onednn" if loader.packing_applies(torch.bfloat16, cpu) else "plain"
    assert kind("auto", torch.bfloat16, runs=True, amx=True) == onednn
    assert kind("auto", torch.bfloat16, runs=True, amx=True, path="amx") == "kvmesh"
    odd = SimpleNamespace(hidden_size=48, intermediate_size=128, num_attention_heads=3)  # k = 48
    monkeypatch.setattr(loader, "kvmesh_gemm_applies", lambda d, dev: True)
    monkeypatch.setattr(loader, "has_amx", lambda: True)
    amx_sized = {None: "amx", 48: "avx512", 64: "amx", 128: "amx"}  # the library's answers
    monkeypatch.setattr(loader, "kvmesh_gemm_path", lambda d, k=None: amx_sized[k])
    assert loader.native_linears(EngineConfig(), odd, torch.bfloat16, cpu) == onednn

    def no_library(dtype: torch.dtype, in_features: int | None = None) -> str:
        raise AssertionError("a CUDA engine asked for the CPU GEMM's path")

    monkeypatch.setattr(loader, "kvmesh_gemm_path", no_library)
    monkeypatch.setattr(loader, "kvmesh_gemm_applies", lambda d, dev: dev.type == "cpu")
    cuda = torch.device("cuda")
    assert loader.native_linears(EngineConfig(), hf, torch.bfloat16, cuda) == "plain"
    assert kind("auto", torch.bfloat16, runs=True, amx=False) == "kvmesh"
    assert kind("kvmesh", torch.float32, runs=True, amx=True) == "kvmesh"
    assert kind("torch", torch.float32, runs=True, amx=False) == "plain"
    if torch.backends.mkldnn.is_available():
        assert kind("torch", torch.float32, runs=True, amx=False, packing="on") == "onednn"
    with caplog.at_level("WARNING", logger="kvmesh.engine.loader"):
        assert kind("kvmesh", torch.float32, runs=False, amx=False) == "plain"
    assert "cpu_gemm=kvmesh" in caplog.text
    assert loader.native_linears(EngineConfig(), hf, torch.float32, torch.device("cuda")) == "plain"


def test_bfloat16_weight_kvmesh_cannot_take_stays_on_onednn() -> None:
    """An odd in_features in bfloat16 (the GEMM takes k in pairs) keeps oneDNN's packed
    linear, which equals F.linear."""
    from kvmesh.engine.cpu_linear import CpuGemmLinear, PackedLinear, packing_applies
    from kvmesh.engine.native.layers import make_linear

    if not packing_applies(torch.bfloat16, torch.device("cpu")):
        pytest.skip("no native bfloat16 matmul on this CPU")
    weight = torch.randn(16, 7).bfloat16()
    linear = make_linear(weight, None, "kvmesh")
    assert type(linear) is PackedLinear and not isinstance(linear, CpuGemmLinear)
    x = torch.randn(3, 7).bfloat16()
    assert torch.equal(linear(x), torch.nn.functional.linear(x, weight))
