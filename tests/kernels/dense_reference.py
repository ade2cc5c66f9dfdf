"""Float64 dense attention and random paged caches with known logical K/V, for kernel tests.

Both the torch reference tests and the Triton tests compare against `dense_attention`, which
knows nothing about paging: it takes one sequence's logical context K/V.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch
from kvmesh_kernels import KVCacheSpec, PagedKVCache, allocate_kv_cache, write_kv


def dense_attention(
    q: torch.Tensor,
    k_ctx: torch.Tensor,
    v_ctx: torch.Tensor,
    scale: float,
    causal_offset: int | None = None,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Exact attention of one sequence in float64.

    q [q_len, Hq, D]; k_ctx, v_ctx [seq_len, Hkv, D]. Query i sits at position
    causal_offset + i (default seq_len - q_len: the last q_len tokens) and sees key t iff
    t <= pos and (no window or t > pos - sliding_window), as transformers' masks.
    Returns [q_len, Hq, D] float64; rows that see no key are zeros.
    """
    q_len, num_q_heads, _ = q.shape
    seq_len, hkv, _ = k_ctx.shape
    offset = seq_len - q_len if causal_offset is None else causal_offset
    group = num_q_heads // hkv
    k = k_ctx.double().repeat_interleave(group, dim=1)  # [seq_len, Hq, D]
    v = v_ctx.double().repeat_interleave(group, dim=1)  # [seq_len, Hq, D]
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale  # [Hq, q_len, seq_len]
    pos = torch.arange(q_len).view(-1, 1) + offset  # [q_len, 1]
    t = torch.arange(seq_len).view(1, -1)  # [1, seq_len]
    visible = t <= pos
    if sliding_window is not None:
        visible &= t > pos - sliding_window
    scores = scores.masked_fill(~visible, float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # [Hq, q_len, seq_len]
    return torch.einsum("hqk,khd->qhd", probs, v)  # [q_len, Hq, D]


@dataclass
class RandomPagedCache:
    """A cache whose sequences' blocks sit in random physical order, plus the logical K/V."""

    cache: PagedKVCache
    block_tables: torch.Tensor  # [batch, max_blocks] int32
    seq_lens: torch.Tensor  # [batch] int32
    keys: list[torch.Tensor]  # per sequence [seq_len, Hkv, D] (model dtype, as written)
    values: list[torch.Tensor]  # per sequence [seq_len, Hkv, D]


def slots_for(block_row: list[int], start: int, stop: int, block_size: int) -> torch.Tensor:
    """Slots [stop - start] int64 of logical positions start..stop-1 through a block table row."""
    pos = torch.arange(start, stop)
    blocks = torch.tensor(block_row, dtype=torch.int64)[pos // block_size]
    return blocks * block_size + pos % block_size


def random_paged_cache(
    seq_lens: list[int],
    *,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype = torch.float32,
    kv_dtype: str = "auto",
    num_layers: int = 1,
    extra_blocks: int = 3,
    key_outlier_channels: int = 0,
    generator: torch.Generator | None = None,
) -> RandomPagedCache:
    """Write random K/V for each sequence into layer 0 through shuffled block tables.

    Unused block-table entries and spare blocks hold random garbage, so reading outside a
    context shows up as an error. `key_outlier_channels` scales that many K channels by 20.
    """
    gen = generator or torch.Generator().manual_seed(random.randrange(2**31))
    need = [-(-n // block_size) for n in seq_lens]
    max_blocks = max([*need, 1]) + 1
    num_blocks = sum(need) + extra_blocks
    spec = KVCacheSpec(num_blocks, num_layers, block_size, num_kv_heads, head_dim, dtype, kv_dtype)
    cache = allocate_kv_cache(spec)
    if not spec.quantized:
        cache.data.copy_(torch.randn(spec.data_shape, generator=gen).to(dtype) * 7)
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables = torch.randint(0, num_blocks, (len(seq_lens), max_blocks), generator=gen)
    keys, values = [], []
    for b, n in enumerate(seq_lens):
        row, perm = perm[: need[b]], perm[need[b] :]
        tables[b, : need[b]] = torch.tensor(row, dtype=torch.int64)
        k = torch.randn(n, num_kv_heads, head_dim, generator=gen)  # [n, Hkv, D]
        if key_outlier_channels:
            k[..., :key_outlier_channels] *= 20.0
        v = torch.randn(n, num_kv_heads, head_dim, generator=gen)  # [n, Hkv, D]
        k, v = k.to(dtype), v.to(dtype)
        for layer in range(num_layers):
            write_kv(cache.layer(layer), k, v, slots_for(row, 0, n, block_size))
        keys.append(k)
        values.append(v)
    return RandomPagedCache(
        cache,
        tables.to(torch.int32),
        torch.tensor(seq_lens, dtype=torch.int32),
        keys,
        values,
    )


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """‖out − ref‖ / ‖ref‖ in float64 (0 when both are zero)."""
    num = (out.double() - ref.double()).norm().item()
    den = ref.double().norm().item()
    return num / den if den > 0 else num
