"""CPU steps of the native executor as one recorded program (`decode_program`).

A step of n token rows over b sequences runs the same kernel calls as the eager forward
(`NativeCausalLM.forward` with the fused CPU kernels), recorded once at start as a
`kvmesh_kernels.cpu_program.Program` over static buffers of `max_tokens` token rows and
`max_seqs` sequences and replayed with (n, b): the calls, their arguments and so their
results are the eager path's, bit for bit, without the per-call Python (wrappers, fresh
output tensors, ctypes) that leaves the OpenMP team idle between kernels. The step's
metadata is copied into `StaticStepInputs`.

    stream [R, hidden]   embedding rows, then the residual stream (updated in place)
    h [R, hidden]        a norm's output, a linear's input
    qkv [R, (Hq + 2 Hkv) D], attn [R, Hq, D], o [R, hidden], act [R, I], down [R, hidden]
    out [R, hidden]      the final norm: the step's hidden states (rows [0, n))

It replays decode steps and mixed steps (decodes with prompt chunks) in which every sequence
attends through the cache: chunks with cached context, or any chunk where the runner sends
first chunks through the paged kernel too. A step with a "fresh" first chunk (attended by
torch's sdpa on the step's own K/V, `kvmesh.engine.attention`) or more rows than the program
has runs eagerly (`MAX_TOKEN_ROWS` bounds the static buffers' memory). It applies where the
eager forward would take exactly these kernels: CPU, float32 or bfloat16, kvmesh's GEMM for
q|k|v, o and down and its SiLU-and-mul epilogue for gate|up, the fused norms (Qwen3's
per-head q/k norms too) and rotary, a cache the fused attention and KV-write kernels take
(`why_not` names what else runs).
"""

from __future__ import annotations

import ctypes

import torch
from kvmesh_kernels import cpu_attention, cpu_cache_ops, cpu_program, dispatch
from kvmesh_kernels.cache import PagedKVCache
from kvmesh_kernels.cpu_build import ENTRY, WRITE_ENTRY
from torch import nn

from kvmesh.engine.attention import ForwardContext
from kvmesh.engine.cpu_linear import CpuGemmGateUpSilu, CpuGemmLinear
from kvmesh.engine.native.llama import NativeCausalLM, NativeDecoderLayer

MAX_TOKEN_ROWS = 512  # a step of more token rows runs eagerly (bounds the static buffers)


def why_not(model: nn.Module, cache: PagedKVCache) -> str | None:
    """Why steps of `model` over `cache` cannot run as a program (None: they can)."""
    if not isinstance(model, NativeCausalLM):
        return "not the native executor"
    if cache.data.device.type != "cpu" or not cpu_program.supported():
        return "not on CPU with the kernel library"
    backend = dispatch.get_backend(cache.data.device)
    if backend != "torch":
        return f"kernel backend {backend!r} (the program replays the fused CPU kernels)"
    if model.embed.weight.dtype not in (torch.float32, torch.bfloat16):
        return f"dtype {model.embed.weight.dtype}"
    if not (model.rotary.fused and model.norm.fused and type(model.embed) is nn.Embedding):
        return "norms or rotary without the fused kernels"
    if not cpu_attention.supports_layer(cache.layer(0)) or not cpu_cache_ops.supports_layer(
        cache.layer(0)
    ):
        return "a KV cache the fused attention or KV write does not take"
    for layer in model.layers:
        reason = _layer_why_not(layer)  # type: ignore[arg-type]
        if reason is not None:
            return f"layer {layer.index}: {reason}"
    return None


def _layer_why_not(layer: NativeDecoderLayer) -> str | None:
    linears = (layer.qkv, layer.o, layer.down)
    if any(type(linear) is not CpuGemmLinear for linear in linears):
        return "a linear not on kvmesh's GEMM"
    if type(layer.gate_up) is not CpuGemmGateUpSilu:
        return "gate|up without the SiLU-and-mul epilogue"
    norms = (layer.input_norm, layer.post_attention_norm, layer.q_norm, layer.k_norm)
    if (layer.q_norm is None) != (layer.k_norm is None):
        return "a q norm without a k norm, or the reverse"
    if not all(norm.fused for norm in norms if norm is not None):
        return "norms without the fused kernel"
    return None


def _linear(module: nn.Module) -> CpuGemmLinear:
    """A linear `why_not` accepted (kvmesh's GEMM, or its SiLU-and-mul subclass)."""
    assert isinstance(module, CpuGemmLinear)
    return module


class StaticStepInputs:
    """A step's metadata in buffers whose addresses the recorded calls hold: token rows
    [max_tokens] (positions, slots), sequences [max_seqs] (lengths, query starts [+1], block
    tables [max_seqs, max_blocks])."""

    def __init__(self, max_tokens: int, max_seqs: int, max_blocks: int) -> None:
        self.max_tokens, self.max_seqs, self.max_blocks = max_tokens, max_seqs, max_blocks
        self.positions = torch.zeros(max_tokens, dtype=torch.int64)
        self.slot_mapping = torch.zeros(max_tokens, dtype=torch.int64)
        self.seq_lens = torch.ones(max_seqs, dtype=torch.int32)
        self.query_start_loc = torch.arange(max_seqs + 1, dtype=torch.int32)
        self.block_tables = torch.zeros(max_seqs, max_blocks, dtype=torch.int32)

    def fits(self, num_tokens: int, ctx: ForwardContext) -> bool:
        """Whether a step of `num_tokens` rows with `ctx`'s sequences fits the buffers."""
        seqs, width = ctx.block_tables.shape
        return num_tokens <= self.max_tokens and seqs <= self.max_seqs and width <= self.max_blocks

    def load(self, positions: torch.Tensor, ctx: ForwardContext) -> None:
        """Copy a step that `fits` into the leading rows (entries past a sequence's table
        are never read)."""
        n, (b, width) = int(positions.shape[0]), ctx.block_tables.shape
        self.positions[:n].copy_(positions)
        self.slot_mapping[:n].copy_(ctx.slot_mapping)
        self.seq_lens[:b].copy_(ctx.seq_lens)
        self.query_start_loc[: b + 1].copy_(ctx.query_start_loc)
        self.block_tables[:b, :width].copy_(ctx.block_tables)


def paged_step(ctx: ForwardContext) -> bool:
    """Every sequence of the step attends through the cache (no fresh first chunk)."""
    return ctx.num_paged_seqs == ctx.num_seqs and not ctx.fresh_bounds


class CpuStepProgram:
    """Steps of up to `max_tokens` token rows and `max_seqs` sequences through one recorded
    program."""

    def __init__(
        self,
        model: NativeCausalLM,
        cache: PagedKVCache,
        max_tokens: int,
        max_seqs: int,
        max_blocks: int,
    ) -> None:
        reason = why_not(model, cache)
        assert reason is None, reason
        self.model, self.cache = model, cache
        self.inputs = StaticStepInputs(max_tokens, max_seqs, max_blocks)
        self.threads = torch.get_num_threads()
        self.replays = 0
        dtype = model.embed.weight.dtype
        layer0: NativeDecoderLayer = model.layers[0]  # type: ignore[assignment]
        shape = layer0.shape
        hidden = model.embed.weight.shape[1]
        width = sum(layer0.split)  # (Hq + 2 Hkv) * D

        def rows(*shape: int) -> torch.Tensor:
            return torch.zeros((max_tokens, *shape), dtype=dtype)

        self.stream, self.h, self.o, self.down, self.out = (rows(hidden) for _ in range(5))
        self.qkv = rows(width)
        self.attn = rows(shape.num_heads, shape.head_dim)
        self.act = rows(_linear(layer0.gate_up).out_features)
        self.program = cpu_program.Program(dtype, self.threads)
        self._record()

    @property
    def max_tokens(self) -> int:
        """Token rows of the static buffers."""
        return self.inputs.max_tokens

    def _record(self) -> None:
        model, p = self.model, self.program
        for layer in model.layers:
            self._record_layer(layer)  # type: ignore[arg-type]
        norm = model.norm
        p.add_rms_norm(self.down, self.stream, norm.weight, self.out, norm.eps)

    def _record_layer(self, layer: NativeDecoderLayer) -> None:
        p, shape = self.program, layer.shape
        norm = layer.input_norm
        if layer.index == 0:
            p.rms_norm(self.stream, norm.weight, self.h, norm.eps)
        else:
            p.add_rms_norm(self.down, self.stream, norm.weight, self.h, norm.eps)
        qkv, o, down = (_linear(m) for m in (layer.qkv, layer.o, layer.down))
        p.gemm(self.h, qkv.packed_weight, qkv.bias, self.qkv)
        if layer.q_norm is not None and layer.k_norm is not None:  # Qwen3: per-head norms
            q, (k, _) = self._q_view(layer), self._kv_views(layer)
            p.head_rms_norm(q, layer.q_norm.weight, layer.q_norm.eps)
            p.head_rms_norm(k, layer.k_norm.weight, layer.k_norm.eps)
        heads = shape.num_heads + shape.num_kv_heads
        qk = self.qkv.as_strided(
            (self.max_tokens, heads, shape.head_dim), (self.qkv.stride(0), shape.head_dim, 1)
        )  # [R, Hq + Hkv, D]: q's heads, then k's
        table = self.model.rotary
        p.rope(qk, table.cos, table.sin, self.inputs.positions)
        p.params_call(WRITE_ENTRY, self._write_params(layer), "num_tokens")
        p.params_call(ENTRY, self._attention_params(layer), "batch", count="seqs")
        attn = self.attn.view(self.max_tokens, -1)  # [R, Hq * D]
        p.gemm(attn, o.packed_weight, o.bias, self.o)
        post = layer.post_attention_norm
        p.add_rms_norm(self.o, self.stream, post.weight, self.h, post.eps)
        p.gemm_silu_mul(self.h, _linear(layer.gate_up).packed_weight, self.act)
        p.gemm(self.act, down.packed_weight, down.bias, self.down)

    def _q_view(self, layer: NativeDecoderLayer) -> torch.Tensor:
        """q [R, Hq, D]: a view of the q|k|v buffer, as the eager layer splits it."""
        shape = layer.shape
        return self.qkv[:, : layer.split[0]].view(self.max_tokens, shape.num_heads, shape.head_dim)

    def _kv_views(self, layer: NativeDecoderLayer) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v [R, Hkv, D]: views of the q|k|v buffer, as the eager layer splits it."""
        q_width, kv_width, _ = layer.split
        shape = layer.shape
        k = self.qkv[:, q_width : q_width + kv_width]
        v = self.qkv[:, q_width + kv_width :]
        view = (self.max_tokens, shape.num_kv_heads, shape.head_dim)
        return k.view(view), v.view(view)

    def _write_params(self, layer: NativeDecoderLayer) -> ctypes.Structure:
        """The KV write's parameters for `layer` (`cpu_cache_ops.WriteCall`'s, recorded)."""
        cache_layer = self.cache.layer(layer.index)
        call = cpu_cache_ops.WriteCall(cache_layer, self.inputs.slot_mapping)
        k, v = self._kv_views(layer)
        quantized = cache_layer.scales is not None
        assert cpu_cache_ops.kv_writable(cache_layer.data.dtype, quantized, k, v)
        call.prepare(k, v, *cpu_attention.layer_pointers(cache_layer))
        assert call.slots is self.inputs.slot_mapping  # shared, not copied: read each replay
        self.program.keep.append(call)
        return call.params

    def _attention_params(self, layer: NativeDecoderLayer) -> ctypes.Structure:
        """The paged attention's parameters for `layer` (`cpu_attention.FusedCall`'s)."""
        inputs, shape = self.inputs, layer.shape
        cache_layer = self.cache.layer(layer.index)
        call = cpu_attention.FusedCall(
            cache_layer, inputs.block_tables, inputs.seq_lens, inputs.query_start_loc
        )
        q = self._q_view(layer)
        data_ptr, scales_ptr = cpu_attention.layer_pointers(cache_layer)
        call.prepare(
            q, data_ptr, scales_ptr, scale=shape.scale, sliding_window=shape.sliding_window,
            out=self.attn,
        )  # fmt: skip
        shared = (call.tables, call.lens, call.starts)  # not copies: read at each replay
        static = (inputs.block_tables, inputs.seq_lens, inputs.query_start_loc)
        assert all(a is b for a, b in zip(shared, static, strict=True))
        self.program.keep.append(call)
        return call.params

    def applies(self, num_tokens: int, ctx: ForwardContext) -> bool:
        """A step this program was recorded for: its cache and thread count, every sequence
        attended through the cache, within the static buffers."""
        return (
            ctx.kv_cache is self.cache
            and self.inputs.fits(num_tokens, ctx)
            and paged_step(ctx)
            and torch.get_num_threads() == self.threads
            and ctx.attention_plan.backend == "torch"  # as eager: the fused kernels
        )

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        """Hidden states [n, hidden] of a step that `applies` (a view of a buffer the next
        step overwrites)."""
        n = int(input_ids.shape[0])
        self.inputs.load(positions, ctx)
        torch.index_select(self.model.embed.weight, 0, input_ids, out=self.stream[:n])
        self.program.run(n, ctx.num_seqs)
        self.replays += 1
        return self.out[:n]
