"""FusedRMSNorm swapped into bfloat16 CPU models, checked at load."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from kvmesh_kernels.cpu_build import available
from torch import nn

from kvmesh.engine.config import EngineConfig
from kvmesh.engine.cpu_norm import (
    NORM_CLASSES,
    FusedRMSNorm,
    fuse_rms_norms,
    fused_norm_applies,
)
from kvmesh.engine.loader import load_model
from kvmesh.models.tiny import build_tiny_model

needs_library = pytest.mark.skipif(not available(), reason="fused CPU library not built")


class LlamaRMSNorm(nn.Module):  # same name as transformers', a different formula (Gemma's 1 + w)
    def __init__(self, width: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(width, dtype=torch.bfloat16))
        self.variance_epsilon = 1e-6

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return (1.0 + self.weight.float()) * h


@needs_library
@pytest.mark.parametrize(("arch", "norms_per_layer"), [("llama", 2), ("qwen3", 4)])
def test_bf16_load_fuses_every_norm(tmp_path: Path, arch: str, norms_per_layer: int) -> None:
    checkpoint = build_tiny_model(tmp_path, arch, "test", seed=0)
    loaded = load_model(
        EngineConfig(model=str(checkpoint), dtype="bfloat16", device="cpu", executor="transformers")
    )
    fused = [m for m in loaded.model.modules() if isinstance(m, FusedRMSNorm)]
    assert len(fused) == norms_per_layer * loaded.hf_config.num_hidden_layers + 1
    assert not any(type(m).__name__ in NORM_CLASSES for m in loaded.model.modules())


def test_float32_load_keeps_transformers_norms(tmp_path: Path) -> None:
    checkpoint = build_tiny_model(tmp_path, "llama", "test", seed=0)
    loaded = load_model(
        EngineConfig(model=str(checkpoint), dtype="float32", device="cpu", executor="transformers")
    )
    assert not any(isinstance(m, FusedRMSNorm) for m in loaded.model.modules())
    assert fused_norm_applies(torch.bfloat16, torch.device("cpu"))
    assert not fused_norm_applies(torch.float32, torch.device("cpu"))


@needs_library
def test_a_norm_with_another_formula_is_kept() -> None:
    model = nn.Sequential(LlamaRMSNorm(64))
    assert fuse_rms_norms(model) == 0
    assert type(model[0]) is LlamaRMSNorm


def test_fallback_path_is_transformers_formula_exactly() -> None:
    from transformers.models.llama.modeling_llama import LlamaRMSNorm as HFNorm

    original = HFNorm(48, eps=1e-5)
    with torch.no_grad():
        original.weight.copy_(torch.randn(48))
    fused = FusedRMSNorm(original)
    x = torch.randn(5, 48)  # float32: not the kernel's dtype
    assert torch.equal(fused(x), original(x))
