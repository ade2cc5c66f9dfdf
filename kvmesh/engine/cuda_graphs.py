"""Decode-step CUDA graphs over batch-size buckets (EngineConfig `cuda_graphs`, CUDA only).

A decode step (one token per sequence, every sequence attending through the cache) of `n`
sequences runs as the replay of a graph captured for the smallest bucket `b >= n`
(`GRAPH_BUCKETS`, up to `max_num_seqs`): the step's inputs are copied into static buffers
and padded to `b` rows; pad rows write no KV (slot -1), attend to one token of block 0 (a
valid read whose result is dropped) and their hidden rows are sliced off. Prompt and mixed
steps, and decode steps above the largest bucket, run eagerly.

    StaticDecodeInputs   input_ids, positions, slot_mapping [B] int64, seq_lens [B] int32,
                         query_start_loc [B + 1] int32 (0..B, constant), block_tables
                         [B, max_blocks] int32: the buffers every graph reads
    DecodeGraphs         one graph (or, with `capture=False`, the same padded call run
                         eagerly: what CPU tests check) per bucket, captured largest first
                         into one memory pool after an eager warm-up run of each bucket

The graphs read the block table at its full width (max_model_len / block_size), so Triton's
split-K choice may differ from the eager step's (same math, another summation order).
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch
from kvmesh_kernels.cache import PagedKVCache
from kvmesh_kernels.plan import AttentionPlan

from kvmesh.engine.attention import ForwardContext

logger = logging.getLogger(__name__)

GRAPH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256)
PAD_SLOT = -1  # AttentionPlan.write_kv skips these tokens

Forward = Callable[[torch.Tensor, torch.Tensor, ForwardContext], torch.Tensor]


def graph_buckets(max_num_seqs: int, sizes: Sequence[int] = GRAPH_BUCKETS) -> tuple[int, ...]:
    """The bucket sizes up to `max_num_seqs`, ending at `max_num_seqs` itself."""
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
    kept = [size for size in sorted(set(sizes)) if size < max_num_seqs]
    return (*kept, max_num_seqs)


def bucket_for(num_seqs: int, buckets: Sequence[int]) -> int | None:
    """The smallest bucket holding `num_seqs` sequences, None above the largest."""
    index = bisect.bisect_left(buckets, num_seqs)
    return buckets[index] if index < len(buckets) and num_seqs >= 1 else None


class StaticDecodeInputs:
    """The graphs' input buffers for up to `rows` sequences of up to `max_blocks` blocks."""

    def __init__(self, rows: int, max_blocks: int, device: torch.device):
        def zeros(*shape: int, dtype: torch.dtype) -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, device=device)

        self.rows, self.max_blocks = rows, max_blocks
        self.input_ids = zeros(rows, dtype=torch.int64)
        self.positions = zeros(rows, dtype=torch.int64)
        self.slot_mapping = torch.full((rows,), PAD_SLOT, dtype=torch.int64, device=device)
        self.seq_lens = torch.ones(rows, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(rows + 1, dtype=torch.int32, device=device)
        self.block_tables = zeros(rows, max_blocks, dtype=torch.int32)

    def load(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        ctx: ForwardContext,
        bucket: int,
    ) -> None:
        """Copy a decode step of n <= bucket sequences into rows [0, n) and pad [n, bucket)."""
        n, width = ctx.block_tables.shape
        assert n <= bucket <= self.rows and width <= self.max_blocks
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slot_mapping[:n].copy_(ctx.slot_mapping)
        self.seq_lens[:n].copy_(ctx.seq_lens)
        self.block_tables[:n, :width].copy_(ctx.block_tables)
        self.block_tables[:n, width:].zero_()  # entries past a table are never read; kept 0
        self.pad(n, bucket)

    def pad(self, start: int, end: int) -> None:
        """Rows [start, end) as pad rows: token 0 at position 0, no KV write, one-token
        context in block 0."""
        self.input_ids[start:end].zero_()
        self.positions[start:end].zero_()
        self.slot_mapping[start:end].fill_(PAD_SLOT)
        self.seq_lens[start:end].fill_(1)
        self.block_tables[start:end].zero_()

    def context(self, cache: PagedKVCache, bucket: int) -> ForwardContext:
        """A decode ForwardContext over the first `bucket` rows (validated as they are now:
        call after `pad` or `load`)."""
        tables, seq_lens = self.block_tables[:bucket], self.seq_lens[:bucket]
        starts, slots = self.query_start_loc[: bucket + 1], self.slot_mapping[:bucket]
        plan = AttentionPlan(cache, tables, seq_lens, starts, slots)
        return ForwardContext(cache, slots, tables, seq_lens, starts, bucket, bucket, (), plan)


def is_graph_step(ctx: ForwardContext, num_tokens: int) -> bool:
    """A pure decode step: one token per sequence, all attended through the cache."""
    return num_tokens == ctx.num_seqs == ctx.num_paged_seqs and not ctx.fresh_bounds


class DecodeGraphs:
    """Decode steps through per-bucket graphs (see the module doc)."""

    def __init__(
        self,
        forward: Forward,
        cache: PagedKVCache,
        buckets: Sequence[int],
        max_blocks: int,
        capture: bool = True,
    ):
        self.forward_fn, self.cache = forward, cache
        self.buckets = tuple(buckets)
        self.inputs = StaticDecodeInputs(self.buckets[-1], max_blocks, cache.data.device)
        self.capture_graphs = capture
        self._contexts: dict[int, ForwardContext] = {}
        self._graphs: dict[int, Any] = {}  # bucket -> torch.cuda.CUDAGraph
        self._outputs: dict[int, torch.Tensor] = {}  # bucket -> hidden [bucket, hidden]
        self.replays = 0

    def applies(self, num_tokens: int, ctx: ForwardContext) -> bool:
        width = int(ctx.block_tables.shape[1])
        fits = bucket_for(ctx.num_seqs, self.buckets) is not None
        return fits and width <= self.inputs.max_blocks and is_graph_step(ctx, num_tokens)

    @torch.inference_mode()
    def capture(self) -> None:
        """Warm up and capture every bucket, largest first (no KV is written: pad rows)."""
        pool = torch.cuda.graph_pool_handle() if self.capture_graphs else None
        for bucket in reversed(self.buckets):
            self.inputs.pad(0, bucket)
            ctx = self._contexts[bucket] = self.inputs.context(self.cache, bucket)
            ids, positions = self.inputs.input_ids[:bucket], self.inputs.positions[:bucket]
            self.forward_fn(ids, positions, ctx)  # eager warm-up: JIT, lazy allocations
            if not self.capture_graphs:
                continue
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._outputs[bucket] = self.forward_fn(ids, positions, ctx)
            self._graphs[bucket] = graph
        if self.capture_graphs:
            torch.cuda.synchronize()
            logger.info("CUDA graphs captured for decode batch sizes %s", list(self.buckets))

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        """Hidden states [n, hidden] of a decode step that `applies`."""
        n = ctx.num_seqs
        bucket = bucket_for(n, self.buckets)
        assert bucket is not None and bucket in self._contexts, "capture() first"
        self.inputs.load(input_ids, positions, ctx, bucket)
        self.replays += 1
        if not self.capture_graphs:
            ids, pos = self.inputs.input_ids[:bucket], self.inputs.positions[:bucket]
            return self.forward_fn(ids, pos, self._contexts[bucket])[:n]
        self._graphs[bucket].replay()
        return self._outputs[bucket][:n]
