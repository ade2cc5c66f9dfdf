"""The native Llama-family decoder: one flat token batch per step over the paged KV cache.

    x = embed(ids)                                    # [T, hidden]
    per layer:  h, res = norm1(x + res)               # fused residual add + RMSNorm
                q|k|v = qkv(h)                        # one GEMM  [T, (Hq + 2 Hkv) D]
                (Qwen3: per-head RMSNorm of q and k)
                q, k = rotary(q, k, positions)        # cos/sin table lookup
                a = attend(plan, q, k, v)             # paged attention (write K/V, attend)
                x = o(a)
                h, res = norm2(x + res)
                x = down(silu(gate) * up)             # gate|up one GEMM
    hidden = norm(x + res)                            # [T, hidden]

Logits are computed by the runner for the sampled rows only (`compute_logits`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from kvmesh.engine.attention import ForwardContext, attend
from kvmesh.engine.native.layers import RMSNorm, activates, direct_call, silu_and_mul
from kvmesh.engine.native.rope import RotaryTable, StepRotary


@dataclass(frozen=True)
class AttentionShape:
    """Heads of one attention layer and its softmax scale and window."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float
    sliding_window: int | None


class NativeDecoderLayer(nn.Module):
    """One decoder layer with merged weights (built by `kvmesh.engine.native.build`)."""

    def __init__(
        self,
        index: int,
        shape: AttentionShape,
        norms: tuple[RMSNorm, RMSNorm],
        qkv: nn.Module,
        o: nn.Module,
        gate_up: nn.Module,
        down: nn.Module,
        qk_norms: tuple[RMSNorm, RMSNorm] | None,
    ):
        super().__init__()
        self.index = index
        self.shape = shape
        self.input_norm, self.post_attention_norm = norms
        self.qkv, self.o, self.gate_up, self.down = qkv, o, gate_up, down
        self.q_norm: RMSNorm | None = qk_norms[0] if qk_norms else None
        self.k_norm: RMSNorm | None = qk_norms[1] if qk_norms else None
        self.split = (
            shape.num_heads * shape.head_dim,
            shape.num_kv_heads * shape.head_dim,
            shape.num_kv_heads * shape.head_dim,
        )
        self.call_linears_directly(True)

    @property
    def gate_up_activates(self) -> bool:
        """Whether gate_up applies SiLU-and-mul itself (in its GEMM's epilogue): [T, I]."""
        return activates(self.gate_up)

    def call_linears_directly(self, direct: bool) -> None:
        """Call the four linears' kernels directly (eager: skips nn.Module's call machinery
        and hooks) or through their modules (what `torch.compile` traces)."""
        modules = (self.qkv, self.o, self.gate_up, self.down)
        self.linears = tuple(direct_call(m) if direct else m for m in modules)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        rotary: StepRotary,
        ctx: ForwardContext,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, hidden] (the previous layer's output), residual [T, hidden] or None (first
        layer) -> (this layer's output, the residual stream before it)."""
        shape = self.shape
        q, k, v, residual = self.pre_attention(x, residual, rotary)
        out = attend(
            ctx, self.index, q, k, v, scale=shape.scale, sliding_window=shape.sliding_window
        )  # [T, Hq, D]
        return self.post_attention(out, residual)

    def pre_attention(
        self, x: torch.Tensor, residual: torch.Tensor | None, rotary: StepRotary
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Residual add + norm, q|k|v, Qwen3's q/k norms, rotary: (q, k, v, residual).
        The per-layer math before attention (one `torch.compile` region, `native.compiled`)."""
        if residual is None:
            h, residual = self.input_norm(x), x
        else:
            h, residual = self.input_norm.add_forward(x, residual)
        shape = self.shape
        tokens = h.shape[0]
        q, k, v = self.linears[0](h).split(self.split, dim=-1)  # [T, Hq * D], [T, Hkv * D] x 2
        q = q.view(tokens, shape.num_heads, shape.head_dim)  # [T, Hq, D]
        k = k.view(tokens, shape.num_kv_heads, shape.head_dim)  # [T, Hkv, D]
        v = v.view(tokens, shape.num_kv_heads, shape.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm.heads_(q), self.k_norm.heads_(k)  # in place where fused
        q, k = rotary.apply(q, k)  # in place on the fresh qkv output where fused
        return q, k, v, residual

    def post_attention(
        self, out: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """o projection, residual add + norm, the MLP: (layer output, residual). The per-layer
        math after attention (the second `torch.compile` region)."""
        _, o, gate_up, down = self.linears
        x = o(out.reshape(out.shape[0], -1))  # [T, hidden]
        h, residual = self.post_attention_norm.add_forward(x, residual)
        mlp = gate_up(h)  # [T, I] where it activates, else [T, 2I]
        if not self.gate_up_activates:
            mlp = silu_and_mul(mlp)
        return down(mlp), residual


class NativeCausalLM(nn.Module):
    """Embedding, decoder layers, final norm and LM head of a Llama-family model."""

    def __init__(
        self,
        embed: nn.Embedding,
        layers: list[NativeDecoderLayer],
        norm: RMSNorm,
        lm_head: nn.Module,
        rotary: RotaryTable,
    ):
        super().__init__()
        self.embed = embed
        self.layers = nn.ModuleList(layers)
        self.norm = norm
        self.lm_head = lm_head
        self.rotary = rotary

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        """input_ids, positions [T] int64 -> final hidden states [T, hidden]."""
        x = self.embed(input_ids)  # [T, hidden]
        rotary = self.rotary.at(positions)
        residual: torch.Tensor | None = None
        for layer in self.layers:
            x, residual = layer.forward(x, residual, rotary, ctx)  # no hooks: direct call
        assert residual is not None, "a model has at least one layer"
        return self.norm.add_forward(x, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [S, hidden] -> logits [S, vocab] in the model's dtype (the sampler computes
        in float32 where it needs to; greedy rows take the argmax as is)."""
        return self.lm_head(hidden)  # type: ignore[no-any-return]
