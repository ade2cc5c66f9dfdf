"""ModelRunner: the engine's tensor side. One flat token batch per step, no padding.

The runner owns the model and the paged KV cache. Per step it turns the scheduler's plan
(`SchedulerOutput`: chunks of tokens with positions, block tables and slot mappings) into flat
tensors, runs the model's executor (kvmesh's native Llama-family code or transformers' modules,
`kvmesh.engine.executor`) with kvmesh's paged attention, and applies the LM head only
to the rows whose logits are sampled (the last token of each chunk with `sample_seq_ids`).
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate, chain, compress
from operator import attrgetter
from typing import Any, Protocol

import torch
from kvmesh_kernels.cache import KVCacheSpec, PagedKVCache, allocate_kv_cache
from kvmesh_kernels.plan import AttentionPlan

from kvmesh.engine.attention import ForwardContext
from kvmesh.engine.block_table import PersistentBlockTable
from kvmesh.engine.cuda_graphs import DecodeGraphs, graph_buckets
from kvmesh.engine.decode_batch import PersistentDecodeBatch
from kvmesh.engine.executor import executor_for
from kvmesh.engine.loader import LoadedModel


class ChunkPlan(Protocol):
    """What the runner reads from one scheduled chunk (kvmesh.engine.scheduler.ScheduledChunk)."""

    @property
    def seq_id(self) -> str: ...
    @property
    def token_ids(self) -> Sequence[int]: ...
    @property
    def start_pos(self) -> int: ...
    @property
    def block_table(self) -> tuple[int, ...]: ...
    @property
    def slot_mapping(self) -> Sequence[int]: ...
    @property
    def sample_seq_ids(self) -> Sequence[str]: ...


class StepPlan(Protocol):
    """What the runner reads from one step's plan (kvmesh.engine.scheduler.SchedulerOutput)."""

    @property
    def chunks(self) -> Sequence[ChunkPlan]: ...
    @property
    def copy_pairs(self) -> Sequence[tuple[int, int]]: ...


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
    ):
        """`max_blocks_per_seq` (default: the whole pool) bounds one sequence's block table."""
        self.loaded = loaded
        self.executor = executor_for(loaded.model)
        self.device = loaded.device
        self.kv_cache: PagedKVCache = allocate_kv_cache(
            kv_cache_spec(loaded.hf_config, num_blocks, block_size, loaded.dtype, kv_dtype),
            device=self.device,
        )
        self.block_tables = PersistentBlockTable(max_blocks_per_seq or num_blocks)
        self.decode_batch = PersistentDecodeBatch(self.block_tables)
        self.decode_graphs: DecodeGraphs | None = None

    def enable_decode_graphs(self, max_num_seqs: int, capture: bool = True) -> None:
        """Run decode steps of up to `max_num_seqs` sequences through per-bucket CUDA graphs
        (`kvmesh.engine.cuda_graphs`), captured now; `capture=False` runs the same padded
        static-buffer steps eagerly (any device: what CPU tests check)."""
        graphs = DecodeGraphs(
            self.executor.forward,
            self.kv_cache,
            graph_buckets(max_num_seqs),
            self.block_tables.max_blocks,
            capture=capture,
        )
        graphs.capture()
        self.decode_graphs = graphs

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
        memory a KV receiver registers (a shared mapping). Runs on the engine thread; nothing
        else holds the old tensors (every step takes its views from `kv_cache`)."""
        old = self.kv_cache
        same = data.shape == old.data.shape and data.dtype == old.data.dtype
        if not same or (scales is None) != (old.scales is None):
            raise ValueError("move_kv_cache: new tensors must match the cache's shapes and dtypes")
        data.copy_(old.data)
        if scales is not None and old.scales is not None:
            scales.copy_(old.scales)
        self.kv_cache = PagedKVCache(old.spec, data, scales)

    def copy_blocks(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Copy whole blocks src -> dst (all layers, K and V) before a step writes into dst."""
        if not pairs:
            return
        index = torch.tensor(pairs, dtype=torch.int64, device=self.device)  # [N, 2]
        data = self.kv_cache.data
        data.index_copy_(0, index[:, 1], data.index_select(0, index[:, 0]))
        scales = self.kv_cache.scales
        if scales is not None:
            scales.index_copy_(0, index[:, 1], scales.index_select(0, index[:, 0]))

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> torch.Tensor:
        """Run one step; returns float32 logits [num sampling chunks, vocab] in chunk order."""
        batch = self.prepare(plan.chunks)
        graphs, ctx = self.decode_graphs, batch.context
        if graphs is not None and graphs.applies(batch.input_ids.shape[0], ctx):
            hidden = graphs.forward(batch.input_ids, batch.positions, ctx)  # [T, hidden]
        else:
            hidden = self.executor.forward(batch.input_ids, batch.positions, ctx)
        sampled = hidden.index_select(0, batch.sample_rows)  # [S, hidden]
        return self.executor.compute_logits(sampled)  # [S, vocab]

    def prepare(self, chunks: Sequence[ChunkPlan]) -> FlatBatch:
        """Flatten chunks into one varlen batch (single-token chunks first, as scheduled) and
        build the step's AttentionPlan (ValueError on inconsistent chunks, before any write).
        A step of single-token chunks (decodes) is built from the persistent decode batch."""
        counts = list(map(len, map(_TOKEN_IDS, chunks)))
        if sum(counts) == len(chunks):
            return self._prepare_decode(chunks)
        flat = flatten_chunks(chunks)
        query_start_loc = flat.query_start_loc
        tables = self.block_tables.gather(
            list(map(_SEQ_ID, chunks)), list(map(_BLOCK_TABLE, chunks))
        )  # [batch, width] int32, rows updated by diffs
        plan = AttentionPlan(
            self.kv_cache,
            block_tables=tables,
            seq_lens=torch.tensor(flat.seq_lens, dtype=torch.int32),
            query_start_loc=torch.tensor(query_start_loc, dtype=torch.int32),
            slot_mapping=torch.tensor(flat.slots, dtype=torch.int64),
        )  # host tensors, validated once, moved to the cache's device by the plan
        return FlatBatch(
            self._tensor(flat.token_ids, torch.int64),
            self._tensor(flat.positions, torch.int64),
            self._tensor(flat.sample_rows, torch.int64),
            self._context(chunks, plan, query_start_loc),
        )

    def _prepare_decode(self, chunks: Sequence[ChunkPlan]) -> FlatBatch:
        """prepare() of a step whose chunks hold one token each."""
        inputs = self.decode_batch.inputs(chunks)
        plan = AttentionPlan(
            self.kv_cache,
            inputs.block_tables,
            inputs.seq_lens,
            inputs.query_start_loc,
            inputs.slots,
            one_token_each=True,
        )
        samples = list(map(bool, map(_SAMPLES, chunks)))
        rows = self.decode_batch.sample_rows(len(chunks))
        if not all(samples):
            rows = rows[torch.tensor(samples)]
        bounds = range(len(chunks) + 1)  # query_start_loc on the host
        return FlatBatch(
            inputs.token_ids.to(self.device),
            inputs.positions.to(self.device),
            rows.to(self.device),
            self._context(chunks, plan, bounds),
        )

    def _context(
        self, chunks: Sequence[ChunkPlan], plan: AttentionPlan, starts: Sequence[int]
    ) -> ForwardContext:
        """The step's ForwardContext; on CPU trailing first chunks (no cached context) are
        attended by the fresh path. `starts`: query_start_loc on the host."""
        num_paged = len(chunks)
        if self.device.type == "cpu":
            while num_paged and chunks[num_paged - 1].start_pos == 0:
                num_paged -= 1
        return ForwardContext(
            kv_cache=self.kv_cache,
            slot_mapping=plan.slot_mapping,
            block_tables=plan.block_tables,
            seq_lens=plan.seq_lens,
            query_start_loc=plan.query_start_loc,
            num_paged_seqs=num_paged,
            num_paged_tokens=starts[num_paged],
            fresh_bounds=tuple(starts[num_paged:]) if num_paged < len(chunks) else (),
            plan=plan,
        )

    def _tensor(self, values: Any, dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, device=self.device)


_SEQ_ID, _TOKEN_IDS, _START_POS = (
    attrgetter("seq_id"),
    attrgetter("token_ids"),
    attrgetter("start_pos"),
)
_BLOCK_TABLE, _SLOTS, _SAMPLES = (
    attrgetter("block_table"),
    attrgetter("slot_mapping"),
    attrgetter("sample_seq_ids"),
)


@dataclass(frozen=True)
class FlatLists:
    """A step's chunks as flat host lists (see `flatten_chunks`)."""

    token_ids: list[int]  # [T]
    positions: list[int]  # [T]
    slots: list[int]  # [T]
    query_start_loc: list[int]  # [B + 1]
    seq_lens: list[int]  # [B] context incl. this step's tokens
    sample_rows: list[int]  # [S] last row of each chunk that samples


def flatten_chunks(chunks: Sequence[ChunkPlan]) -> FlatLists:
    """Column-wise flattening (C-level map/chain, no per-token Python loop); a step of decodes
    only (one token per chunk) takes positions straight from the start positions."""
    token_tuples = list(map(_TOKEN_IDS, chunks))
    starts = list(map(_START_POS, chunks))
    counts = list(map(len, token_tuples))
    assert all(counts), "empty chunk"
    token_ids = list(chain.from_iterable(token_tuples))
    seq_lens = list(map(operator.add, starts, counts))
    if len(token_ids) == len(chunks):
        positions = starts
    else:
        positions = list(chain.from_iterable(map(range, starts, seq_lens)))
    query_start_loc = [0, *accumulate(counts)]
    last_rows = [end - 1 for end in query_start_loc[1:]]
    return FlatLists(
        token_ids,
        positions,
        list(chain.from_iterable(map(_SLOTS, chunks))),
        query_start_loc,
        seq_lens,
        list(compress(last_rows, map(_SAMPLES, chunks))),
    )


def kv_cache_spec(
    hf_config: Any, num_blocks: int, block_size: int, dtype: torch.dtype, kv_dtype: str
) -> KVCacheSpec:
    """The cache shape a transformers config needs (GQA-aware, explicit head_dim honoured)."""
    heads = int(hf_config.num_attention_heads)
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
    return KVCacheSpec(
        num_blocks=num_blocks,
        num_layers=int(hf_config.num_hidden_layers),
        block_size=block_size,
        num_kv_heads=int(getattr(hf_config, "num_key_value_heads", None) or heads),
        head_dim=int(head_dim),
        dtype=dtype,
        kv_dtype=kv_dtype,
    ).validate()
