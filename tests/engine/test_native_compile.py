"""`compile="on"`: the native executor's per-layer math through torch.compile (inductor).

One tiny Qwen3 (q/k norms, the packed-linear custom op) keeps the compile cost of the suite to
a few seconds; greedy tokens must equal transformers' `generate` in float32.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvmesh import LLM, SamplingParams
from kvmesh.engine.config import EngineConfig
from kvmesh.engine.errors import InvalidParameterError
from kvmesh.models.tiny import build_tiny_model
from tests.engine.test_native_executor import PROMPT, hf_greedy

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.mark.parametrize("gemm", ["torch", "kvmesh"])
def test_compiled_layers_keep_greedy_parity(tmp_path: Path, gemm: str) -> None:
    """Compiled regions call the packed linears through the `kvmesh::packed_linear` op, for
    oneDNN's GEMM (torch, float32 packed where oneDNN runs) and kvmesh's alike."""
    from torch._dynamo.utils import counters

    checkpoint = build_tiny_model(tmp_path / "qwen3", "qwen3", "test", seed=0)
    packing = "on" if torch.backends.mkldnn.is_available() else "off"
    llm = LLM(
        str(checkpoint),
        num_kv_blocks=64,
        dtype="float32",
        compile="on",
        float32_packing=packing,
        cpu_gemm=gemm,
        max_num_batched_tokens=64,  # the 90-token prompt is chunked: prefill, mixed, decode
    )
    layer = llm.engine.runner.loaded.model.layers[0]
    assert hasattr(layer.pre_attention, "_torchdynamo_orig_callable")  # a compiled region
    short = PROMPT[:30]
    outputs = llm.generate([PROMPT, short], GREEDY)
    assert counters["stats"]["unique_graphs"] >= 2  # both regions were compiled and ran
    assert outputs[0].outputs[0].token_ids == hf_greedy(checkpoint, PROMPT, GREEDY.max_tokens)
    assert outputs[1].outputs[0].token_ids == hf_greedy(checkpoint, short, GREEDY.max_tokens)


def test_compile_mode_is_validated() -> None:
    with pytest.raises(InvalidParameterError, match="compile"):
        EngineConfig(compile="max-autotune")
