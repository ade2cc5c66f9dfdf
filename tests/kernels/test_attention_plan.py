"""AttentionPlan: the same cache contents and outputs as the dispatch functions, the same errors.

Each case runs one step twice on copies of the same cache: through a plan (write_kv then
attention, layer by layer) and through `dispatch.write_kv` + `dispatch.paged_attention` with
the same metadata. Caches and outputs must be bitwise equal, for every backend that runs here
("torch": the fused C++ kernel on CPU when it builds; "reference"; "triton" on CUDA or under
TRITON_INTERPRET=1).
"""

from __future__ import annotations

import os
import random
from collections.abc import Iterator
from dataclasses import dataclass

import kvmesh_kernels
import pytest
import torch
from dense_reference import random_paged_cache, slots_for
from kvmesh_kernels import AttentionPlan, PagedKVCache, cpu_build, dispatch

NUM_LAYERS = 2
HKV, HEAD_DIM, BLOCK_SIZE = 2, 64, 8


def _backends() -> list[str]:
    names = ["torch", "reference"]
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    if interpret or torch.cuda.is_available():
        names.append("triton")
    return names


@pytest.fixture(autouse=True)
def _restore_backend() -> Iterator[None]:
    yield
    kvmesh_kernels.set_backend(None)


@dataclass
class Step:
    """One engine step: metadata and this step's q/k/v per layer."""

    cache: PagedKVCache
    block_tables: torch.Tensor  # [batch, max_blocks] int32
    seq_lens: torch.Tensor  # [batch] int32
    query_start_loc: torch.Tensor  # [batch + 1] int32
    slot_mapping: torch.Tensor  # [num_tokens] int64
    queries: list[torch.Tensor]  # per layer [num_tokens, Hq, D]
    keys: list[torch.Tensor]  # per layer [num_tokens, Hkv, D]
    values: list[torch.Tensor]


def make_step(
    q_lens: list[int],
    cached: list[int],
    *,
    dtype: torch.dtype = torch.float32,
    kv_dtype: str = "auto",
    group: int = 4,
    skip: tuple[int, ...] = (),
) -> Step:
    """Sequence b has cached[b] tokens in the cache and computes q_lens[b] more this step;
    the tokens at flat indices `skip` get slot -1."""
    lens = [c + q for c, q in zip(cached, q_lens, strict=True)]
    pc = random_paged_cache(
        lens,
        num_kv_heads=HKV,
        head_dim=HEAD_DIM,
        block_size=BLOCK_SIZE,
        dtype=dtype,
        kv_dtype=kv_dtype,
        num_layers=NUM_LAYERS,
    )
    rows = pc.block_tables.tolist()
    slots = torch.cat(
        [
            slots_for(rows[b], c, n, BLOCK_SIZE)
            for b, (c, n) in enumerate(zip(cached, lens, strict=True))
        ]
    )
    slots[list(skip)] = -1
    starts = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    tokens = sum(q_lens)

    def rand(heads: int) -> list[torch.Tensor]:
        return [torch.randn(tokens, heads, HEAD_DIM).to(dtype) for _ in range(NUM_LAYERS)]

    return Step(
        pc.cache,
        pc.block_tables,
        pc.seq_lens,
        starts,
        slots,
        rand(HKV * group),
        rand(HKV),
        rand(HKV),
    )


def clone(cache: PagedKVCache) -> PagedKVCache:
    scales = None if cache.scales is None else cache.scales.clone()
    return PagedKVCache(cache.spec, cache.data.clone(), scales)


def on(device: torch.device, step: Step) -> Step:
    scales = None if step.cache.scales is None else step.cache.scales.to(device)
    return Step(
        PagedKVCache(step.cache.spec, step.cache.data.to(device), scales),
        *(t.to(device) for t in (step.block_tables, step.seq_lens, step.query_start_loc)),
        step.slot_mapping.to(device),
        *([t.to(device) for t in ts] for ts in (step.queries, step.keys, step.values)),
    )


def device_for(backend: str) -> torch.device:
    if backend == "triton" and os.environ.get("TRITON_INTERPRET") != "1":
        return torch.device("cuda")
    return torch.device("cpu")


def run_both(
    step: Step, window: int | None, num_seqs: int | None = None
) -> tuple[list[torch.Tensor], list[torch.Tensor], PagedKVCache, PagedKVCache]:
    """(plan outputs, dispatch outputs, plan cache, dispatch cache) over every layer."""
    n = step.seq_lens.shape[0] if num_seqs is None else num_seqs
    rows = int(step.query_start_loc[n])
    cache_a, cache_b = clone(step.cache), clone(step.cache)
    plan = AttentionPlan(
        cache_a, step.block_tables, step.seq_lens, step.query_start_loc, step.slot_mapping
    )
    outs_a, outs_b = [], []
    scale = HEAD_DIM**-0.5
    for i in range(NUM_LAYERS):
        plan.write_kv(i, step.keys[i], step.values[i])
        outs_a.append(
            plan.attention(
                step.queries[i][:rows], i, scale=scale, sliding_window=window, num_seqs=num_seqs
            )
        )
        layer = cache_b.layer(i)
        kvmesh_kernels.write_kv(layer, step.keys[i], step.values[i], step.slot_mapping)
        outs_b.append(
            kvmesh_kernels.paged_attention(
                step.queries[i][:rows],
                layer,
                step.block_tables[:n],
                step.seq_lens[:n],
                step.query_start_loc[: n + 1],
                scale=scale,
                sliding_window=window,
            )
        )
    return outs_a, outs_b, cache_a, cache_b


def assert_same(step: Step, window: int | None, num_seqs: int | None = None) -> None:
    outs_a, outs_b, cache_a, cache_b = run_both(step, window, num_seqs)
    assert torch.equal(cache_a.data.view(torch.uint8), cache_b.data.view(torch.uint8))
    if cache_a.scales is not None and cache_b.scales is not None:
        assert torch.equal(cache_a.scales, cache_b.scales)
    for a, b in zip(outs_a, outs_b, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a, b)


CASES = {
    "fp32_mixed": ({}, [1, 1, 9, 1, 12], [30, 7, 20, 0, 5], None),
    "bf16_mixed": ({"dtype": torch.bfloat16}, [1, 5, 1, 17], [40, 3, 12, 0], None),
    "f16_decode": ({"dtype": torch.float16}, [1, 1, 1], [25, 3, 60], None),
    "int8_mixed": ({"kv_dtype": "int8"}, [1, 6, 1], [33, 10, 2], None),
    "fp8_window": ({"kv_dtype": "fp8"}, [1, 6, 1], [33, 10, 2], 5),
    "window_mixed": ({}, [1, 13, 1, 4], [50, 20, 9, 0], 7),
    "slot_skip": ({"skip": (0, 4, 5)}, [1, 8, 1], [18, 4, 3], None),
}


@pytest.mark.parametrize("backend", _backends())
@pytest.mark.parametrize("case", sorted(CASES))
def test_plan_matches_dispatch(backend: str, case: str) -> None:
    kwargs, q_lens, cached, window = CASES[case]
    torch.manual_seed(0)
    random.seed(0)
    kvmesh_kernels.set_backend(backend)
    step = on(device_for(backend), make_step(q_lens, cached, **kwargs))  # type: ignore[arg-type]
    assert_same(step, window)


@pytest.mark.parametrize("backend", ["torch", "reference"])
def test_plan_prefix_of_sequences_matches_dispatch(backend: str) -> None:
    """The engine attends only the leading sequences when trailing chunks take the sdpa path."""
    torch.manual_seed(1)
    kvmesh_kernels.set_backend(backend)
    step = make_step([1, 1, 6, 11, 9], [20, 3, 12, 0, 0])
    assert_same(step, None, num_seqs=3)
    assert_same(step, 4, num_seqs=0)


def test_plan_uses_fused_kernel_on_cpu() -> None:
    if not cpu_build.enabled() or not cpu_build.available():
        pytest.skip("fused CPU kernel unavailable")
    kvmesh_kernels.set_backend("torch")
    step = make_step([1, 3], [5, 0])
    plan = AttentionPlan(
        step.cache, step.block_tables, step.seq_lens, step.query_start_loc, step.slot_mapping
    )
    assert plan._fused is not None
    kvmesh_kernels.set_backend("reference")
    plan = AttentionPlan(
        step.cache, step.block_tables, step.seq_lens, step.query_start_loc, step.slot_mapping
    )
    assert plan._fused is None


def _error(fn) -> str:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError) as info:
        fn()
    return str(info.value)


BAD = {
    # name: (field, replacement builder)
    "seq_lens_too_long": ("seq_lens", lambda s: s.seq_lens + 1000),
    "chunk_longer_than_context": ("seq_lens", lambda s: torch.tensor([9, 1, 4], dtype=torch.int32)),
    "empty_chunk": ("query_start_loc", lambda s: torch.tensor([0, 1, 1, 7], dtype=torch.int32)),
    "starts_wrong_length": ("query_start_loc", lambda s: s.query_start_loc[:-1]),
    "starts_decreasing": (
        "query_start_loc",
        lambda s: torch.tensor([0, 5, 2, 7], dtype=torch.int32),
    ),
    "slot_too_large": ("slot_mapping", lambda s: s.slot_mapping + 10_000),
    "slot_below_minus_one": ("slot_mapping", lambda s: s.slot_mapping - 10_000),
    "slots_wrong_length": ("slot_mapping", lambda s: s.slot_mapping[:-1]),
    "float_slots": ("slot_mapping", lambda s: s.slot_mapping.float()),
    "tables_3d": ("block_tables", lambda s: s.block_tables[None]),
}


def _dispatch_error(step: Step, field: str) -> str:
    """The message dispatch gives for the same bad field (write_kv for slots, else attention)."""
    layer = clone(step.cache).layer(0)
    if field == "slot_mapping":
        return _error(
            lambda: kvmesh_kernels.write_kv(layer, step.keys[0], step.values[0], step.slot_mapping)
        )
    return _error(
        lambda: kvmesh_kernels.paged_attention(
            step.queries[0],
            layer,
            step.block_tables,
            step.seq_lens,
            step.query_start_loc,
            scale=0.1,
        )
    )


@pytest.mark.parametrize("name", sorted(BAD))
def test_plan_rejects_bad_metadata_like_dispatch(name: str) -> None:
    torch.manual_seed(2)
    kvmesh_kernels.set_backend("torch")
    good = make_step([1, 1, 5], [8, 3, 0])
    field, build = BAD[name]
    bad = Step(**{**good.__dict__, field: build(good)})
    before = bad.cache.data.clone()
    message = _error(
        lambda: AttentionPlan(
            bad.cache, bad.block_tables, bad.seq_lens, bad.query_start_loc, bad.slot_mapping
        )
    )
    assert torch.equal(bad.cache.data, before)  # nothing written
    assert message == _dispatch_error(bad, field)


def test_plan_checks_per_layer_shapes() -> None:
    torch.manual_seed(3)
    step = make_step([1, 4], [6, 0])
    plan = AttentionPlan(
        step.cache, step.block_tables, step.seq_lens, step.query_start_loc, step.slot_mapping
    )
    with pytest.raises(ValueError, match="key must be"):
        plan.write_kv(0, step.keys[0][:, :1], step.values[0][:, :1])
    with pytest.raises(ValueError, match="num_tokens=5"):
        plan.write_kv(0, step.keys[0][:3], step.values[0][:3])
    with pytest.raises(ValueError, match="num_tokens=5"):
        plan.attention(step.queries[0][:4], 0, scale=0.1)
    with pytest.raises(ValueError, match="num_q_heads"):
        plan.attention(step.queries[0][:, :3], 0, scale=0.1)
    with pytest.raises(ValueError, match="scale"):
        plan.attention(step.queries[0], 0, scale=0.0)
    with pytest.raises(IndexError):
        plan.attention(step.queries[0], NUM_LAYERS, scale=0.1)
    assert dispatch.get_backend(torch.device("cpu")) == plan.backend


def test_one_token_each_plan_equals_the_general_plan_and_checks_the_same() -> None:
    torch.manual_seed(2)
    kvmesh_kernels.set_backend("torch")
    step = make_step([1, 1, 1], [25, 3, 60])
    args = (step.cache, step.block_tables, step.seq_lens, step.query_start_loc, step.slot_mapping)
    fast, general = AttentionPlan(*args, one_token_each=True), AttentionPlan(*args)
    assert (fast.num_tokens, fast.q_lens, fast.starts) == (3, [1, 1, 1], [0, 1, 2, 3])
    assert (fast.q_lens, fast.starts) == (general.q_lens, general.starts)
    scale = HEAD_DIM**-0.5
    fast_out = fast.attention(step.queries[0], 0, scale=scale)
    assert torch.equal(fast_out, general.attention(step.queries[0], 0, scale=scale))
    too_long = step.seq_lens.clone()
    too_long[1] = step.block_tables.shape[1] * BLOCK_SIZE + 1
    prefill_bounds = torch.tensor([0, 1, 3, 4], dtype=torch.int32)
    for bad, match in (
        ((too_long, step.query_start_loc), "seq_lens must lie"),
        ((torch.zeros_like(step.seq_lens), step.query_start_loc), "seq_lens must lie"),
        ((step.seq_lens, prefill_bounds), "0..batch"),
        ((step.seq_lens, step.query_start_loc[:3]), r"\[batch \+ 1\]"),
    ):
        with pytest.raises(ValueError, match=match):
            AttentionPlan(
                step.cache, step.block_tables, *bad, step.slot_mapping, one_token_each=True
            )
