"""ModelRunner: the engine's tensor side. One flat token batch per step, no padding.

The runner owns the model and the paged KV cache. Per step it applies the scheduler's plan
(`SchedulerOutput`: the step's columns and the block-table diffs) to its persistent batch
(`input_batch.py`), builds flat tensors from it, runs the model's executor (kvmesh's native
Llama-family code or transformers' modules, `kvmesh.engine.executor`) with kvmesh's paged
attention, and applies the LM head only to the rows whose logits are sampled (the last token of
each chunk that samples).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from kvmesh_kernels.cache import KVCacheSpec, PagedKVCache, allocate_kv_cache
from kvmesh_kernels.plan import AttentionPlan
from kvmesh_kernels.reference_cache_ops import torch_copy_blocks

from kvmesh.engine.attention import ForwardContext
from kvmesh.engine.cuda_graphs import DecodeGraphs, graph_buckets
from kvmesh.engine.executor import executor_for
from kvmesh.engine.fresh_attention import ProbeShape, fresh_rule
from kvmesh.engine.hf_shapes import head_dim_of
from kvmesh.engine.input_batch import HostInputs, PersistentBatch
from kvmesh.engine.loader import LoadedModel
from kvmesh.engine.native import step_program
from kvmesh.engine.scheduler.plan import SchedulerOutput


@dataclass(frozen=True)
class FlatBatch:
    """One step's model inputs on the device.

    input_ids, positions: [num_tokens] int64; sample_rows: [num_sampled] int64 indices into the
    flat tokens (one per chunk that samples, in chunk order).
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    sample_rows: torch.Tensor
    context: ForwardContext


class ModelRunner:
    """Runs a loaded model on a paged KV cache of `num_blocks` blocks."""

    def __init__(
        self,
        loaded: LoadedModel,
        num_blocks: int,
        block_size: int,
        kv_dtype: str,
        max_blocks_per_seq: int | None = None,
        fresh_attention: str = "auto",
    ):
        """`max_blocks_per_seq` (default: the whole pool) bounds one sequence's block table;
        `fresh_attention` (auto | on | off) picks the first-chunk path (`fresh_attention.py`)."""
        self.loaded = loaded
        self.executor = executor_for(loaded.model)
        self.device = loaded.device
        self.kv_cache: PagedKVCache = allocate_kv_cache(
            kv_cache_spec(loaded.hf_config, num_blocks, block_size, loaded.dtype, kv_dtype),
            device=self.device,
        )
        self.batch = PersistentBatch(max_blocks_per_seq or num_blocks)
        spec = self.kv_cache.spec
        heads = int(loaded.hf_config.num_attention_heads)
        shape = ProbeShape(heads, spec.num_kv_heads, spec.head_dim, spec.dtype, spec.kv_dtype)
        self.fresh_rule = fresh_rule(fresh_attention, self.device, shape)
        self.decode_graphs: DecodeGraphs | None = None
        self._graph_options = (0, False)  # enable_decode_graphs' arguments
        self.decode_program: step_program.CpuStepProgram | None = None

    def enable_decode_graphs(self, max_num_seqs: int, capture: bool = True) -> None:
        """Run decode steps of up to `max_num_seqs` sequences through per-bucket CUDA graphs
        (`kvmesh.engine.cuda_graphs`), captured now; `capture=False` runs the same padded
        static-buffer steps eagerly (any device: what CPU tests check)."""
        graphs = DecodeGraphs(
            self.executor.forward,
            self.kv_cache,
            graph_buckets(max_num_seqs),
            self.batch.max_blocks,
            capture=capture,
        )
        graphs.capture()
        self.decode_graphs = graphs
        self._graph_options = (max_num_seqs, capture)

    def enable_decode_program(
        self, max_num_seqs: int, max_num_batched_tokens: int = 0
    ) -> str | None:
        """Run CPU steps of up to `max_num_seqs` sequences, every one attended through the
        cache, as one recorded program (`kvmesh.engine.native.step_program`): decode steps,
        and mixed steps of up to max(max_num_seqs, min(max_num_batched_tokens,
        MAX_TOKEN_ROWS)) token rows. Returns why not where it cannot (None: enabled)."""
        self.decode_program = None  # a rebuild that cannot run keeps no old program (or cache)
        reason = step_program.why_not(self.loaded.model, self.kv_cache)
        if reason is None:
            cap = min(max_num_batched_tokens, step_program.MAX_TOKEN_ROWS)
            self.decode_program = step_program.CpuStepProgram(
                self.loaded.model,
                self.kv_cache,
                max(max_num_seqs, cap),
                max_num_seqs,
                self.batch.max_blocks,
            )
        return reason

    @property
    def block_size(self) -> int:
        return self.kv_cache.spec.block_size

    @property
    def num_blocks(self) -> int:
        return self.kv_cache.spec.num_blocks

    @property
    def vocab_size(self) -> int:
        return int(self.loaded.hf_config.vocab_size)

    def move_kv_cache(self, data: torch.Tensor, scales: torch.Tensor | None) -> None:
        """Re-home the cache into `data` (and `scales`), same shapes and dtypes, contents kept:
        memory a KV receiver registers (a shared mapping). Runs on the engine thread; every step
        takes its views from `kv_cache`. The KV tiers hold the cache too: move it through
        `LLMEngine.move_kv_cache`, which rebinds them."""
        old = self.kv_cache
        same = data.shape == old.data.shape and data.dtype == old.data.dtype
        if not same or (scales is None) != (old.scales is None):
            raise ValueError("move_kv_cache: new tensors must match the cache's shapes and dtypes")
        data.copy_(old.data)
        if scales is not None and old.scales is not None:
            scales.copy_(old.scales)
        self.kv_cache = PagedKVCache(old.spec, data, scales)
        if self.decode_graphs is not None:  # its static plans and graphs read the old cache
            self.enable_decode_graphs(*self._graph_options)
        if self.decode_program is not None:  # so does the program's recorded calls
            inputs = self.decode_program.inputs
            self.enable_decode_program(inputs.max_seqs, inputs.max_tokens)

    def copy_blocks(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Copy whole blocks src -> dst (all layers, K and V, and their scales in a quantized
        cache) before a step writes into dst (the kernels' torch copy: fp8 moves as bytes)."""
        if not pairs:
            return
        index = torch.tensor(pairs, dtype=torch.int64, device=self.device)  # [N, 2]
        torch_copy_blocks(self.kv_cache, index)

    def execute(self, plan: SchedulerOutput) -> torch.Tensor:
        """Run one step; returns logits [num sampling chunks, vocab] in chunk order, in the
        model's dtype."""
        return self.execute_keeping(plan, None)[0]

    @torch.inference_mode()
    def execute_keeping(
        self, plan: SchedulerOutput, rows: list[int] | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`execute`, also returning the final hidden states [len(rows), hidden] of the flat
        token rows `rows` (None: none kept)."""
        batch = self.prepare(plan)
        graphs, program, ctx = self.decode_graphs, self.decode_program, batch.context
        tokens = batch.input_ids.shape[0]
        if graphs is not None and graphs.applies(tokens, ctx):
            hidden = graphs.forward(batch.input_ids, batch.positions, ctx)  # [T, hidden]
        elif program is not None and program.applies(tokens, ctx):
            hidden = program.forward(batch.input_ids, batch.positions, ctx)  # [T, hidden]
        else:
            hidden = self.executor.forward(batch.input_ids, batch.positions, ctx)
        kept = None
        if rows is not None:
            kept = hidden.index_select(0, torch.tensor(rows, device=hidden.device))  # [R, hidden]
        sampled = hidden.index_select(0, batch.sample_rows)  # [S, hidden]
        return self.executor.compute_logits(sampled), kept  # [S, vocab]

    def prepare(self, plan: SchedulerOutput) -> FlatBatch:
        """Apply the plan's table diffs, build the flat varlen batch (decodes first, as
        scheduled) and the step's AttentionPlan (ValueError on inconsistent input, before any
        write)."""
        self.batch.apply(plan)
        inputs = self.batch.inputs(plan, self.block_size)
        attention = AttentionPlan(
            self.kv_cache,
            inputs.block_tables,
            inputs.seq_lens,
            inputs.query_start_loc,
            inputs.slots,
            one_token_each=plan.num_decodes == len(plan.seq_ids),
        )  # host tensors, validated once, moved to the cache's device by the plan
        device = self.device
        return FlatBatch(
            inputs.token_ids.to(device),
            inputs.positions.to(device),
            inputs.sample_rows.to(device),
            self._context(inputs, attention),
        )

    def _context(self, inputs: HostInputs, plan: AttentionPlan) -> ForwardContext:
        """The step's ForwardContext; on CPU trailing first chunks (no cached context) are
        attended by the fresh path where it pays (`self.fresh_rule`)."""
        starts, bounds = inputs.starts, plan.starts  # bounds: query_start_loc on the host
        count = num_paged = len(starts)
        if self.device.type == "cpu" and count and not starts[-1]:
            started = np.flatnonzero(starts)
            num_paged = int(started[-1]) + 1 if len(started) else 0
            if not self.fresh_rule.pays(bounds[num_paged:]):
                num_paged = count
        return ForwardContext(
            kv_cache=self.kv_cache,
            slot_mapping=plan.slot_mapping,
            block_tables=plan.block_tables,
            seq_lens=plan.seq_lens,
            query_start_loc=plan.query_start_loc,
            num_paged_seqs=num_paged,
            num_paged_tokens=bounds[num_paged],
            fresh_bounds=tuple(bounds[num_paged:]) if num_paged < count else (),
            plan=plan,
        )


def kv_cache_spec(
    hf_config: Any, num_blocks: int, block_size: int, dtype: torch.dtype, kv_dtype: str
) -> KVCacheSpec:
    """The cache shape a transformers config needs (GQA-aware, explicit head_dim honoured)."""
    heads = int(hf_config.num_attention_heads)
    head_dim = head_dim_of(hf_config)
    return KVCacheSpec(
        num_blocks=num_blocks,
        num_layers=int(hf_config.num_hidden_layers),
        block_size=block_size,
        num_kv_heads=int(getattr(hf_config, "num_key_value_heads", None) or heads),
        head_dim=int(head_dim),
        dtype=dtype,
        kv_dtype=kv_dtype,
    ).validate()
