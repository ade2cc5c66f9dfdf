"""Per-step attention plan: the step's metadata validated once, then cheap per-layer calls.

Every layer of a model step writes K/V at the same slots and attends through the same block
tables. `dispatch.write_kv` and `dispatch.paged_attention` re-validate that metadata on every
call (host reads, Python loops) and rebuild the kernel arguments; an `AttentionPlan` does it
once per step::

    plan = AttentionPlan(cache, block_tables, seq_lens, query_start_loc, slot_mapping)
    for i in range(num_layers):
        plan.write_kv(i, key, value)                          # [T, Hkv, D] each
        out = plan.attention(query, i, scale=s)               # [T, Hq, D] -> [T, Hq, D]

The backend is dispatch's, chosen when the plan is built (`get_backend` of the cache's
device): Triton on CUDA, "torch" (the fused C++ kernel on CPU when it supports the cache, else
the torch reference) or "reference". Outputs and cache contents are identical to the dispatch
functions called with the same arguments, and bad metadata raises the same `ValueError`s,
from the constructor, before anything is written.
"""

from __future__ import annotations

import functools
import itertools

import torch

from kvmesh_kernels import cpu_attention, cpu_cache_ops, dispatch
from kvmesh_kernels.cache import LayerKV, PagedKVCache
from kvmesh_kernels.dispatch import _check
from kvmesh_kernels.reference_attention import torch_paged_attention
from kvmesh_kernels.reference_cache_ops import SlotIndex, slot_index, torch_write_kv_at


class AttentionPlan:
    """One step's attention metadata over one cache, validated and prepared.

    block_tables [batch, max_blocks] int32 (or int64), seq_lens [batch] (context lengths
    including this step's tokens), query_start_loc [batch + 1] (chunk bounds in the flat token
    batch, every chunk at least one token), slot_mapping [num_tokens] integer (-1 skips a
    token). Tensors may be on the host; the plan keeps copies on the cache's device (the
    attributes of the same names). Validating reads them on the host once (a synchronization
    when they are on a GPU). Not thread-safe: one plan serves one forward pass.
    """

    def __init__(
        self,
        cache: PagedKVCache,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        query_start_loc: torch.Tensor,
        slot_mapping: torch.Tensor,
        *,
        one_token_each: bool = False,
    ) -> None:
        """`one_token_each`: a decode step (query_start_loc must be 0..batch), checked with
        a few vectorized reductions instead of per-sequence host lists."""
        spec = cache.spec
        dispatch._check_tables(block_tables, seq_lens)
        capacity = block_tables.shape[1] * spec.block_size
        if one_token_each:
            q_lens = _check_one_token_each(seq_lens, query_start_loc, capacity)
        else:
            q_lens = dispatch._host_q_lens(None, seq_lens.shape[0], query_start_loc)
            _check(
                not q_lens or min(q_lens) >= 1,
                "paged_attention needs q_len >= 1 for every sequence",
            )
            dispatch._check_host_lengths(seq_lens.tolist(), capacity, q_lens)
        self.num_tokens = sum(q_lens)
        dispatch._check_slots(slot_mapping, self.num_tokens)
        dispatch._check_slot_range(slot_mapping, spec.num_blocks * spec.block_size)

        device = cache.data.device
        self.cache = cache
        self.batch = len(q_lens)
        self.q_lens = q_lens
        self.starts = [0, *itertools.accumulate(q_lens)]  # host copy of query_start_loc
        self.block_tables = block_tables.to(device)  # [batch, max_blocks]
        self.seq_lens = seq_lens.to(device)  # [batch]
        self.query_start_loc = query_start_loc.to(device)  # [batch + 1]
        self.slot_mapping = slot_mapping.to(device)  # [num_tokens]
        self.backend = dispatch.get_backend(device)
        self._slot_index: SlotIndex | None = None  # torch write path, built on first use

    @functools.cached_property
    def _fused(self) -> cpu_attention.FusedCall | None:
        """The fused CPU kernel's call over this step's metadata, built at the first layer's
        attention (a step the runner replays as a recorded program never needs it)."""
        layer0 = self.cache.layer(0)
        if self.backend == "torch" and cpu_attention.supports_layer(layer0):
            return cpu_attention.FusedCall(
                layer0, self.block_tables, self.seq_lens, self.query_start_loc
            )
        return None

    @functools.cached_property
    def _write(self) -> cpu_cache_ops.WriteCall | None:
        """The CPU KV-write kernel's call over this step's slots, built at the first write."""
        layer0 = self.cache.layer(0)
        if self.backend == "torch" and cpu_cache_ops.supports_layer(layer0):
            return cpu_cache_ops.WriteCall(layer0, self.slot_mapping)
        return None

    def layer(self, index: int) -> LayerKV:
        """The cache's layer view `index` (IndexError when out of range)."""
        return self.cache.layer(index)

    def write_kv(self, layer: int, key: torch.Tensor, value: torch.Tensor) -> None:
        """Store key/value [num_tokens, Hkv, D] of this step at its slots in layer `layer`
        (quantizing when the cache is int8/fp8); tokens with slot -1 are skipped."""
        spec = self.cache.spec
        data_ptr, scales_ptr = self._pointers(layer)  # IndexError when out of range
        dispatch._check_kv(key, value, spec.num_kv_heads, spec.head_dim)
        _check(
            key.shape[0] == self.num_tokens,
            f"key must have num_tokens={self.num_tokens} rows, got {key.shape[0]}",
        )
        if self.backend == "triton":
            dispatch._triton("write_kv")(self.layer(layer), key, value, self.slot_mapping)
            return
        if self._write is not None and cpu_cache_ops.kv_writable(
            self.cache.data.dtype, spec.quantized, key, value
        ):
            self._write(key, value, data_ptr, scales_ptr)  # the layer was checked at build
            return
        if self._slot_index is None:
            self._slot_index = slot_index(self.slot_mapping, spec.block_size)
        torch_write_kv_at(self.layer(layer), key, value, self._slot_index)

    def attention(
        self,
        query: torch.Tensor,
        layer: int,
        *,
        scale: float,
        sliding_window: int | None = None,
        num_seqs: int | None = None,
    ) -> torch.Tensor:
        """Paged attention of the first `num_seqs` sequences (default all) in layer `layer`:
        query [their tokens, Hq, D] -> [their tokens, Hq, D] in query.dtype, each chunk the
        last q_len tokens of its context, causal over the whole cached context (written
        before this call)."""
        n = self.batch if num_seqs is None else num_seqs
        _check(0 <= n <= self.batch, f"num_seqs must lie in [0, {self.batch}], got {n}")
        spec = self.cache.spec
        dispatch._check_query(query, spec.num_kv_heads, spec.head_dim)
        tokens = self.starts[n]
        _check(
            query.shape[0] == tokens,
            f"query must have num_tokens={tokens} rows, got {query.shape[0]}",
        )
        dispatch._check_scale(scale, sliding_window)
        if self._fused is not None and query.device.type == "cpu":
            return self._fused(
                query,
                *self._pointers(layer),
                scale=scale,
                sliding_window=sliding_window,
                batch=n,
            )
        args = (
            query,
            self.cache.layer(layer),
            self.block_tables[:n],
            self.seq_lens[:n],
        )
        if self.backend == "triton":
            if tokens == n:
                return dispatch._triton("decode")(  # type: ignore[no-any-return]
                    *args, scale=scale, sliding_window=sliding_window
                )
            return dispatch._triton(
                "prefill"
            )(  # type: ignore[no-any-return]
                *args, self.query_start_loc[: n + 1], scale=scale, sliding_window=sliding_window
            )
        return torch_paged_attention(
            *args, self.query_start_loc[: n + 1], scale=scale, sliding_window=sliding_window
        )

    def _pointers(self, layer: int) -> tuple[int, int]:
        """(data, scales) addresses of layer `layer`'s view, without building the view."""
        cache = self.cache
        if not 0 <= layer < cache.spec.num_layers:
            raise IndexError(f"layer index {layer} out of range [0, {cache.spec.num_layers})")
        data = cache.data
        data_ptr = data.data_ptr() + layer * data.stride(1) * data.element_size()
        if cache.scales is None:
            return data_ptr, 0
        scales = cache.scales
        return data_ptr, scales.data_ptr() + layer * scales.stride(1) * scales.element_size()


def _check_one_token_each(
    seq_lens: torch.Tensor, query_start_loc: torch.Tensor, capacity: int
) -> list[int]:
    """The checks of a general plan for q_len 1 everywhere; returns the q_lens (all 1)."""
    batch = int(seq_lens.shape[0])
    _check(
        query_start_loc.dim() == 1 and query_start_loc.shape[0] == batch + 1,
        "query_start_loc must be [batch + 1]",
    )
    if batch:
        expected = _counting(batch + 1, query_start_loc.dtype)
        _check(
            torch.equal(query_start_loc.cpu(), expected),
            "one_token_each needs query_start_loc = 0..batch",
        )
        low, high = torch.aminmax(seq_lens)
        _check(
            int(low) >= 1 and int(high) <= capacity,
            f"seq_lens must lie in [1, max_blocks * block_size = {capacity}] "
            "(a query chunk longer than its seq_lens context otherwise)",
        )
    return [1] * batch


@functools.lru_cache(maxsize=16)
def _counting(n: int, dtype: torch.dtype) -> torch.Tensor:
    """0..n - 1 in `dtype` [n], kept for the next plans of a decode batch that size (only
    compared, never written)."""
    return torch.arange(n, dtype=dtype)
