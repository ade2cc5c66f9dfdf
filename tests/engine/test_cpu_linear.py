"""oneDNN-packed linear layers: bit-identical to nn.Linear, applied only where they pay."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from kvmesh.engine.config import EngineConfig
from kvmesh.engine.cpu_linear import PackedLinear, pack_linear_layers, packing_applies
from kvmesh.engine.loader import load_model
from kvmesh.models.tiny import build_tiny_model

CPU = torch.device("cpu")
needs_bf16 = pytest.mark.skipif(
    not packing_applies(torch.bfloat16, CPU), reason="oneDNN has no native bfloat16 on this CPU"
)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("llama"), "llama", "test", seed=0)


@needs_bf16
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(0, 48), (1, 48), (37, 48), (1, 5, 48)])
def test_packed_linear_is_bit_identical(bias: bool, shape: tuple[int, ...]) -> None:
    torch.manual_seed(0)
    linear = nn.Linear(48, 80, bias=bias, dtype=torch.bfloat16)
    x = torch.randn(shape, dtype=torch.bfloat16)
    expected = linear(x)  # [..., 80]
    packed = PackedLinear(linear)
    got = packed(x)
    assert got.shape == expected.shape and got.dtype == torch.bfloat16
    assert torch.equal(got, expected)


@needs_bf16
def test_packed_linear_reads_strided_input() -> None:
    linear = nn.Linear(32, 16, bias=False, dtype=torch.bfloat16)
    x = torch.randn(6, 64, dtype=torch.bfloat16)[:, ::2]  # [6, 32], stride 2
    assert torch.equal(PackedLinear(linear)(x), linear(x))


def test_packing_applies_only_to_half_precision_on_cpu() -> None:
    assert not packing_applies(torch.float32, CPU)
    assert not packing_applies(torch.bfloat16, torch.device("cuda"))


@needs_bf16
def test_bf16_load_packs_every_linear_and_keeps_outputs(checkpoint: Path) -> None:
    from transformers import AutoModelForCausalLM

    loaded = load_model(
        EngineConfig(model=str(checkpoint), dtype="bfloat16", device="cpu", executor="transformers")
    )
    modules = list(loaded.model.modules())
    assert not any(type(m) is nn.Linear for m in modules)
    layers = loaded.hf_config.num_hidden_layers
    assert sum(isinstance(m, PackedLinear) for m in modules) == 7 * layers + 1
    plain = AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.bfloat16)
    hidden = torch.randn(3, loaded.hf_config.hidden_size, dtype=torch.bfloat16)
    with torch.inference_mode():
        for name in ("lm_head", "model.layers.0.self_attn.q_proj", "model.layers.1.mlp.down_proj"):
            ours = loaded.model.get_submodule(name)
            theirs = plain.get_submodule(name)
            width = theirs.in_features
            x = torch.randn(3, width, dtype=torch.bfloat16) if width != hidden.shape[1] else hidden
            assert torch.equal(ours(x), theirs(x)), name


def test_float32_load_keeps_plain_linears(checkpoint: Path) -> None:
    loaded = load_model(
        EngineConfig(model=str(checkpoint), dtype="float32", device="cpu", executor="transformers")
    )
    assert not any(isinstance(m, PackedLinear) for m in loaded.model.modules())


@needs_bf16
def test_pack_linear_layers_counts_and_skips_packed() -> None:
    model = nn.Sequential(nn.Linear(16, 16, dtype=torch.bfloat16), nn.ReLU())
    assert pack_linear_layers(model) == 1
    assert pack_linear_layers(model) == 0  # already packed
