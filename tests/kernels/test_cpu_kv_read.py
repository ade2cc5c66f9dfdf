"""The benchmarks' paged K/V read (csrc/cpu_kv_read.cpp): it reads exactly the K and V rows of
each sequence's tokens through its block table, once each, and refuses bad arguments."""

from __future__ import annotations

import functools
import operator

import numpy as np
import pytest
import torch
from kvmesh_kernels import KVCacheSpec, allocate_kv_cache, cpu_build, cpu_kv_read
from kvmesh_kernels.cache import LayerKV
from kvmesh_kernels.cpu_kv_read import available, read_kv


@pytest.fixture(scope="module", autouse=True)
def _library() -> None:
    if not cpu_build.enabled() or not available():
        pytest.skip("CPU kernel library unavailable")


def run_xor(run: bytes) -> int:
    """The read's fold of one run: 64-bit words of whole 64-byte lines, then bytes one by one."""
    whole = len(run) // 64 * 64
    words = np.frombuffer(run[:whole], dtype=np.uint64)
    acc = int(np.bitwise_xor.reduce(words)) if words.size else 0
    return functools.reduce(operator.xor, run[whole:], acc)


def expected_xor(layer: LayerKV, tables: torch.Tensor, lens: torch.Tensor) -> int:
    """Every sequence's K rows then V rows of each block's tokens, as separate runs."""
    acc, bs = 0, layer.block_size
    for b, n in enumerate(lens.tolist()):
        for j in range(-(-n // bs)):
            tokens = min(bs, n - j * bs)
            for half in (0, 1):
                rows = layer.data[int(tables[b, j]), half, :tokens].contiguous()
                acc ^= run_xor(rows.view(torch.uint8).numpy().tobytes())
    return acc & (2**63 - 1)


@pytest.mark.parametrize(
    ("dtype", "heads", "dim"),
    [(torch.float32, 3, 64), (torch.bfloat16, 2, 64), (torch.bfloat16, 1, 12)],
)
@pytest.mark.parametrize("threads", [1, 2])
def test_read_covers_each_sequences_rows_once(
    dtype: torch.dtype, heads: int, dim: int, threads: int
) -> None:
    block_size, layers = 16, 2
    lens = torch.tensor([1, 16, 17, 40, 0, 95], dtype=torch.int32)  # partial and empty blocks
    need = [-(-n // block_size) for n in lens.tolist()]
    spec = KVCacheSpec(sum(need) + 4, layers, block_size, heads, dim, dtype)
    cache = allocate_kv_cache(spec)
    cache.data.view(torch.uint8).random_(0, 256, generator=torch.Generator().manual_seed(3))
    perm = torch.randperm(spec.num_blocks, generator=torch.Generator().manual_seed(4))
    tables = torch.full((len(need), max(need)), -1, dtype=torch.int32)
    first = 0
    for b, n in enumerate(need):
        tables[b, :n] = perm[first : first + n].to(torch.int32)
        first += n
    layer = cache.layer(1)
    got = read_kv(layer, tables, lens, num_threads=threads)
    assert got == expected_xor(layer, tables, lens)
    # a sequence left out changes the result: every row counts
    assert read_kv(layer, tables[:-1], lens[:-1], num_threads=threads) != got


def test_read_refuses_bad_arguments() -> None:
    spec = KVCacheSpec(4, 1, 16, 2, 64, torch.float32)
    layer = allocate_kv_cache(spec).layer(0)
    tables = torch.zeros(2, 2, dtype=torch.int32)
    with pytest.raises(ValueError, match="seq_lens"):
        read_kv(layer, tables, torch.ones(2, dtype=torch.int64))
    with pytest.raises(ValueError, match="match block_tables"):
        read_kv(layer, tables, torch.ones(3, dtype=torch.int32))
    with pytest.raises(ValueError, match="block_tables"):
        read_kv(layer, tables.to(torch.int64), torch.ones(2, dtype=torch.int32))
    strided = LayerKV(layer.data.transpose(2, 3), None, "auto", torch.float32)
    with pytest.raises(ValueError, match="contiguous"):
        read_kv(strided, tables, torch.ones(2, dtype=torch.int32))


def test_ids_clamp_lengths_cap_and_negative_lengths_read_nothing() -> None:
    spec = KVCacheSpec(6, 1, 16, 2, 64, torch.float32)
    cache = allocate_kv_cache(spec)
    cache.data.view(torch.uint8).random_(0, 256, generator=torch.Generator().manual_seed(5))
    layer = cache.layer(0)
    lens = torch.tensor([20], dtype=torch.int32)
    inside = torch.tensor([[2, spec.num_blocks - 1]], dtype=torch.int32)
    beyond = torch.tensor([[2, spec.num_blocks + 7]], dtype=torch.int32)  # clamped to the last
    assert read_kv(layer, beyond, lens) == read_kv(layer, inside, lens)
    two_blocks = torch.tensor([32], dtype=torch.int32)
    assert read_kv(layer, inside, torch.tensor([900], dtype=torch.int32)) == read_kv(
        layer, inside, two_blocks
    )  # capped at the table's two blocks
    both = torch.tensor([[2, 3], [4, 5]], dtype=torch.int32)
    assert read_kv(layer, both, torch.tensor([20, -5], dtype=torch.int32)) == read_kv(
        layer, both[:1], lens
    )
    with pytest.raises(ValueError, match="num_threads"):
        read_kv(layer, inside, lens, num_threads=0)


def test_the_c_entry_refuses_what_the_wrapper_would() -> None:
    """The C contract on its own: -1 for a null pointer or a block half too short."""
    spec = KVCacheSpec(2, 1, 16, 2, 64, torch.float32)
    data = allocate_kv_cache(spec).layer(0).data
    tables, lens = torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32)
    fields = dict(
        data=data.data_ptr(),
        tables=tables.data_ptr(),
        lens=lens.data_ptr(),
        batch=1,
        max_blocks=1,
        num_blocks=2,
        block_size=16,
        elem_bytes=4,
        token_bytes=2 * 64 * 4,
        s_block=data.stride(0),
        s_kv=data.stride(1),
        num_threads=1,
    )
    entry = cpu_kv_read._entry()
    assert entry(cpu_kv_read._ReadParams(**fields)) >= 0
    assert entry(cpu_kv_read._ReadParams(**{**fields, "tables": 0})) == -1
    assert entry(cpu_kv_read._ReadParams(**{**fields, "token_bytes": 4 * 64 * 4})) == -1
