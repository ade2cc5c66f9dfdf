"""Rotary position embedding from a precomputed cos/sin table indexed by positions.

The inverse frequencies and the attention scaling come from transformers' own rotary module
(`model.model.rotary_emb`), which computed them for the config's `rope_type`. Only the rope
types whose frequencies do not depend on the sequence length are served here: `default`,
`linear`, `llama3` and `yarn`. Others (`dynamic`, `longrope`, ...) raise UnsupportedModelError
at load, and `executor="auto"` keeps transformers' code for them.

The table holds exactly what transformers computes per call, `cos(p * inv_freq) * scaling` in
float32 then cast to the model dtype, for every position `p < max_positions`; rotation is the
"rotate half" (NeoX) form Llama-family checkpoints use.
"""

from __future__ import annotations

from typing import Any

import torch
from kvmesh_kernels import cpu_fused

from kvmesh.engine.errors import UnsupportedModelError

STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def rope_params(hf_config: Any) -> dict[str, Any]:
    """The config's rope parameters (transformers' `rope_parameters`, or the older
    `rope_scaling`); empty when it declares none."""
    params = getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None)
    return dict(params or {})


def rope_type(hf_config: Any) -> str:
    """The config's rope type ("default" when it declares no scaling)."""
    params = rope_params(hf_config)
    if not params:
        return "default"
    return str(params.get("rope_type", params.get("type", "default")))


def check_rope(hf_config: Any) -> None:
    """Raise UnsupportedModelError for a rope type the table cannot hold."""
    kind = rope_type(hf_config)
    if kind not in STATIC_ROPE_TYPES:
        raise UnsupportedModelError(
            f"rope_type {kind!r} is not implemented by the native executor "
            f"(implemented: {', '.join(STATIC_ROPE_TYPES)}); use --executor transformers"
        )


class RotaryTable:
    """cos/sin [max_positions, head_dim] in the model dtype; `at(positions)` rotates a step."""

    def __init__(
        self, rotary_module: Any, max_positions: int, dtype: torch.dtype, device: torch.device
    ):
        inv_freq = rotary_module.inv_freq.detach().float().cpu()  # [D / 2]
        scaling = float(getattr(rotary_module, "attention_scaling", 1.0))
        positions = torch.arange(max_positions, dtype=torch.float32)  # [P]
        freqs = torch.outer(positions, inv_freq)  # [P, D / 2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [P, D]
        self.cos = (emb.cos() * scaling).to(dtype).to(device)  # [P, D]
        self.sin = (emb.sin() * scaling).to(dtype).to(device)  # [P, D]
        self.max_positions = max_positions
        self.fused = cpu_fused.fused_supported(self.cos)  # in-place CPU kernel, decided once

    def at(self, positions: torch.Tensor) -> StepRotary:
        """The rotation of one step's tokens at positions [T] int64."""
        return StepRotary(self, positions)


class StepRotary:
    """Rotates q [T, Hq, D] and k [T, Hkv, D] of one step: in place by the fused CPU kernel
    (float32, bfloat16), else with table rows looked up once per step (here, so that `apply`
    has no side effects: it runs inside `torch.compile` regions)."""

    def __init__(self, table: RotaryTable, positions: torch.Tensor):
        self.table = table
        self.positions = positions  # [T] int64
        self.fused = table.fused
        if not self.fused:
            self.cos = table.cos[positions].unsqueeze(1)  # [T, 1, D]
            self.sin = table.sin[positions].unsqueeze(1)

    def apply(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.fused and q.stride(-1) == 1 and k.stride(-1) == 1:
            table = self.table
            if _heads_follow(q, k):  # q|k of one qkv output: one call over both
                qk = q.as_strided((q.shape[0], q.shape[1] + k.shape[1], q.shape[2]), q.stride())
                cpu_fused.rope_(qk, table.cos, table.sin, self.positions)  # [T, Hq + Hkv, D]
                return q, k
            cpu_fused.rope_(q, table.cos, table.sin, self.positions)
            cpu_fused.rope_(k, table.cos, table.sin, self.positions)
            return q, k
        if self.fused:  # a strided q/k the kernel cannot take (the layers produce none)
            cos = self.table.cos[self.positions].unsqueeze(1)  # [T, 1, D]
            sin = self.table.sin[self.positions].unsqueeze(1)
            return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        return apply_rotary(q, self.cos, self.sin), apply_rotary(k, self.cos, self.sin)


def _heads_follow(q: torch.Tensor, k: torch.Tensor) -> bool:
    """k's heads continue q's in memory: same token and head strides, k's first head right
    after q's last (q and k split from one q|k|v row)."""
    return (
        q.stride() == k.stride()
        and q.shape[0] == k.shape[0]
        and k.data_ptr() == q.data_ptr() + q.shape[1] * q.stride(1) * q.element_size()
    )


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] -> x * cos + rotate_half(x) * sin, transformers' arithmetic exactly."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)  # [T, H, D]
    return x * cos + rotated * sin
