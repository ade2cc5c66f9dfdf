"""The native executor's fused CPU ops vs transformers' Llama-family formulas.

bfloat16: every product and sum rounds as torch's does, so results are bitwise equal except
where a float32 sum of squares (norms) runs in another order: within one bf16 rounding there,
or where SiLU's float32 value lies within an ulp of a bf16 rounding boundary (none in these
inputs). float32: within a few ulps (sum order, exp and rsqrt implementations).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from kvmesh_kernels.cpu_build import available
from kvmesh_kernels.cpu_fused import (
    add_rms_norm,
    argmax_rows,
    fused_supported,
    head_rms_norm_,
    logprob_rows,
    race_rows,
    rms_norm,
    rope_,
    silu_mul,
    top_cut,
)

pytestmark = pytest.mark.skipif(not available(), reason="fused CPU library not built")

DTYPES = (torch.float32, torch.bfloat16)


def hf_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """LlamaRMSNorm.forward, verbatim."""
    h = x.to(torch.float32)
    variance = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(variance + eps)
    return weight * h.to(x.dtype)


def close(expected: torch.Tensor, got: torch.Tensor) -> bool:
    e, g = expected.float(), got.float()
    step = 2.0**-7 if expected.dtype == torch.bfloat16 else 2.0**-20
    return bool(((e - g).abs() <= e.abs() * step + 1e-6).all())


def randn(*shape: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=generator) * 2).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 7, 300])
def test_add_rms_norm_matches_add_then_norm(dtype: torch.dtype, rows: int) -> None:
    x = randn(rows, 2 * 576, dtype=dtype, seed=rows)[:, :576]  # a row-strided view
    residual = randn(rows, 576, dtype=dtype, seed=rows + 1)
    weight = randn(576, dtype=dtype, seed=3)
    total = x + residual
    expected = hf_norm(total, weight, 1e-5)
    assert fused_supported(x, residual, weight)
    got = add_rms_norm(x, residual, weight, 1e-5)
    assert torch.equal(residual, total)  # the residual stream, updated in place
    assert close(expected, got)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_of_strided_rows(dtype: torch.dtype) -> None:
    x = randn(33, 256, dtype=dtype, seed=5)[:, :128]
    weight = randn(128, dtype=dtype, seed=6)
    assert close(hf_norm(x, weight, 1e-6), rms_norm(x, weight, 1e-6))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [1, 5, 200])
def test_head_rms_norm_normalizes_each_head_in_place_as_rms_norm(
    dtype: torch.dtype, tokens: int
) -> None:
    """Qwen3's q/k norms on views of a q|k|v row: each head exactly as `rms_norm` of that
    head's row, close to transformers' formula, and the columns around the view untouched."""
    heads, dim = 4, 64
    qkv = randn(tokens, heads * dim + 3 * dim, dtype=dtype, seed=tokens)  # q | k | v (padded)
    before = qkv.clone()
    k = qkv[:, heads * dim : heads * dim + dim].view(tokens, 1, dim)  # one kv head
    q = qkv[:, : heads * dim].view(tokens, heads, dim)  # [T, H, D], token-strided
    weight = randn(dim, dtype=dtype, seed=7)
    expected = rms_norm(before[:, : heads * dim].reshape(-1, dim), weight, 1e-6)  # [T * H, D]
    head_rms_norm_(q, weight, 1e-6)
    assert torch.equal(q.reshape(-1, dim), expected)
    assert close(hf_norm(before[:, : heads * dim].view(tokens, heads, dim), weight, 1e-6), q)
    assert torch.equal(qkv[:, heads * dim :], before[:, heads * dim :])  # k and v untouched
    head_rms_norm_(k, weight, 1e-6)
    assert torch.equal(
        k.reshape(-1, dim), rms_norm(before[:, heads * dim : (heads + 1) * dim], weight, 1e-6)
    )


def hf_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_in_place_on_strided_heads_is_bitwise(dtype: torch.dtype) -> None:
    tokens, heads, dim = 19, 9, 64
    qkv = randn(tokens, (heads + 6) * dim, dtype=dtype, seed=8)
    q = qkv[:, : heads * dim].view(tokens, heads, dim)  # strided rows inside the qkv output
    freqs = torch.outer(torch.arange(100.0), 1.0 / 10000 ** (torch.arange(0, dim, 2) / dim))
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)  # [100, D]
    positions = torch.randint(0, 100, (tokens,), generator=torch.Generator().manual_seed(9))
    expected = hf_rope(q, cos[positions][:, None], sin[positions][:, None])
    rest = qkv[:, heads * dim :].clone()
    rope_(q, cos, sin, positions)
    assert torch.equal(q, expected)
    assert torch.equal(qkv[:, heads * dim :], rest)  # k and v untouched


def test_rope_refuses_a_position_outside_the_table() -> None:
    x = torch.zeros(2, 1, 8)
    table = torch.zeros(4, 8)
    with pytest.raises(RuntimeError, match="code 2"):
        rope_(x, table, table, torch.tensor([0, 4]))


def torch_silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """The native executor's torch formula (and transformers' LlamaMLP's)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def assert_silu_matches(gate_up: torch.Tensor) -> None:
    """float32 within 2^-20 relative of torch's; bfloat16 bitwise."""
    expected, got = torch_silu_mul(gate_up), silu_mul(gate_up)
    assert got.shape == expected.shape and got.dtype == expected.dtype and got.is_contiguous()
    if gate_up.dtype == torch.bfloat16:
        assert torch.equal(expected, got)
    else:
        e, g = expected.double(), got.double()
        assert bool(((e - g).abs() <= e.abs() * 2.0**-20).all())


# (rows, intermediate): one row and many, vector-width remainders (7, 17, 33, 1377), the
# bench model's 1376 and SmolLM2-135M's 1536, and sizes over the kernel's threading threshold
SILU_SHAPES = [(1, 1376), (1, 7), (3, 17), (24, 1536), (101, 1376), (300, 33), (64, 1377)]
SILU_SHAPES += [(2048, 40)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SILU_SHAPES)
def test_silu_mul_matches_torch(dtype: torch.dtype, shape: tuple[int, int]) -> None:
    rows, n = shape
    assert_silu_matches(randn(rows, 2 * n, dtype=dtype, seed=rows + n) * 2)  # gates in +-12


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_of_strided_rows(dtype: torch.dtype) -> None:
    wide = randn(37, 3 * 96, dtype=dtype, seed=11)
    assert_silu_matches(wide[:, : 2 * 96])  # rows 288 elements apart
    assert_silu_matches(wide[5:6, 96:])  # one row of a view


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_special_values_match_torch(dtype: torch.dtype) -> None:
    gate = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 1e-40, -1e-40])
    gate = torch.cat([gate, torch.tensor([88.7, -88.7, -89.0, -104.0, -200.0, 100.0, -87.5])])
    up = torch.cat([torch.ones(7), torch.full((7,), 3.0)])
    gate_up = torch.cat([gate, up])[None].to(dtype)  # [1, 28]
    expected, got = torch_silu_mul(gate_up), silu_mul(gate_up)
    assert torch.equal(expected.isnan(), got.isnan())
    assert torch.equal(expected.nan_to_num(0.5), got.nan_to_num(0.5))
    assert torch.equal(expected.signbit(), got.signbit())  # -0 where exp(-g) overflows


def test_silu_mul_of_no_rows() -> None:
    assert silu_mul(torch.zeros(0, 8)).shape == (0, 4)


def test_unsupported_inputs_are_reported() -> None:
    assert not fused_supported(torch.zeros(2, 4, dtype=torch.float16))
    assert not fused_supported(torch.zeros(4, 2).t())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("rows", "n"), [(1, 1), (3, 15), (5, 16), (7, 17), (300, 1000), (4, 49157)]
)
def test_argmax_rows_matches_torch_max_with_ties(dtype: torch.dtype, rows: int, n: int) -> None:
    """Few distinct values, so most rows tie at their maximum: the first index wins."""
    generator = torch.Generator().manual_seed(rows * n)
    ties = torch.randint(-4, 4, (rows, 2 * n), generator=generator).to(dtype)[:, :n]
    assert fused_supported(ties)
    assert torch.equal(argmax_rows(ties), ties.max(dim=-1).indices)
    spread = randn(rows, n + 3, dtype=dtype, seed=n)[:, 3:]  # rows strided, unaligned
    assert torch.equal(argmax_rows(spread), spread.max(dim=-1).indices)


@pytest.mark.parametrize("dtype", DTYPES)
def test_argmax_rows_special_values_match_torch(dtype: torch.dtype) -> None:
    inf, nan = float("inf"), float("nan")
    rows = torch.zeros(10, 40)
    rows[0] = -inf  # every value -inf: the first
    rows[1, 33] = nan  # a NaN wins over every number
    rows[2, 5], rows[2, 37] = nan, nan  # the first NaN
    rows[3, 7], rows[3, 20] = inf, inf
    rows[4] = nan
    rows[5, 17], rows[5, 39] = inf, nan
    rows[6, :] = -inf
    rows[6, 39] = -1.0  # in the tail, after the vector lanes
    rows[7, 16:] = 3.0  # ties in every lane
    rows[8] = -inf
    rows[8, 21] = nan
    rows[9] = torch.arange(40.0).flip(0)  # the first is the largest
    x = rows.to(dtype)
    assert torch.equal(argmax_rows(x), x.max(dim=-1).indices)


def race_counts(logits: torch.Tensor, inv_temp: float, draws: int, seed: int) -> torch.Tensor:
    """Token frequencies of `draws` races over one row of logits, one random key each."""
    rows = logits.expand(draws, -1).contiguous()  # [draws, n]
    keys = torch.randint(0, 2**62, (draws,), generator=torch.Generator().manual_seed(seed))
    tokens = race_rows(rows, torch.full((draws,), inv_temp), keys)
    return torch.bincount(tokens, minlength=logits.numel()).float() / draws


@pytest.mark.parametrize("inv_temp", [1.0, 0.25, 4.0])
def test_race_rows_draws_from_the_tempered_softmax(inv_temp: float) -> None:
    probs = torch.tensor([0.5, 0.25, 0.15, 0.07, 0.03])
    logits = probs.log()  # [5], below one vector of lanes: the scalar tail
    freq = race_counts(logits, inv_temp, 100_000, seed=1)
    expected = (logits * inv_temp).softmax(dim=-1)
    assert (freq - expected).abs().max() < 0.006  # about 4 standard errors
    wide = torch.randn(300, generator=torch.Generator().manual_seed(2)) * 2  # lanes and tail
    freq = race_counts(wide, inv_temp, 100_000, seed=3)
    expected = (wide * inv_temp).softmax(dim=-1)
    assert ((freq - expected).abs() <= 5 * (expected / 100_000).sqrt() + 1e-4).all()


def test_race_rows_depends_only_on_the_key_and_never_draws_minus_inf() -> None:
    logits = randn(6, 49157, dtype=torch.float32, seed=4)
    logits[:, ::2] = float("-inf")  # half the vocabulary can never be drawn
    logits[3] = logits[0]  # and the same key as row 0
    keys = torch.tensor([11, 12, 13, 11, 2**62 + 5, 0])
    ones = torch.ones(6)
    tokens = race_rows(logits, ones, keys)
    assert tokens[0] == tokens[3] and bool((tokens % 2 == 1).all())
    for r in range(6):  # alone, in a batch of one: the same draws
        assert race_rows(logits[r : r + 1], ones[:1], keys[r : r + 1]).item() == tokens[r]
    as_bf16 = logits.to(torch.bfloat16)  # bfloat16 rows widen exactly: same scores
    assert torch.equal(race_rows(as_bf16, ones, keys), race_rows(as_bf16.float(), ones, keys))
    broadcast = logits[:1].expand(64, -1)  # one row read 64 times (row stride 0)
    draws = race_rows(broadcast, torch.ones(64), torch.arange(64))
    assert len(set(draws.tolist())) > 32


def sorted_reference(logits: torch.Tensor, top_k, top_p, min_p) -> list[set[int]]:
    """Kept tokens per row by the sampler's torch filters: min_p, then top_k and top_p on the
    sorted row."""
    from kvmesh.engine.sampler import apply_min_p, apply_top_k_top_p

    masked = apply_top_k_top_p(apply_min_p(logits, min_p), top_k, top_p)
    return [set(torch.isfinite(row).nonzero().squeeze(1).tolist()) for row in masked]


@pytest.mark.parametrize("scale", [4.0, 1.0], ids=["peaked", "flat"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_top_cut_keeps_what_the_sorted_filters_keep(scale: float, dtype: torch.dtype) -> None:
    rows, vocab = 12, 20_000
    logits = (randn(rows, vocab, dtype=torch.float32, seed=7) * scale / 2).to(dtype)
    top_k = torch.tensor([0, 1, 5, 50, 0, 0, 3000, 0, 40, 0, 2, 0])
    top_p = torch.tensor([0.9, 1.0, 0.5, 0.95, 0.3, 1.0, 0.99, 0.999, 1.0, 0.7, 0.1, 0.8])
    min_p = torch.tensor([0.0] * 6 + [0.01, 0.0, 0.0, 0.2, 0.0, 0.0])
    inv_temp = torch.tensor([1.0, 2.0, 0.5] * 4)
    floors = top_cut(logits, inv_temp, top_k, top_p, min_p)
    tempered = logits.float() * inv_temp.unsqueeze(1)
    expected = sorted_reference(tempered, top_k, top_p, min_p)
    pairs = zip(tempered, floors, strict=True)
    got = [set((row >= f).nonzero().squeeze(1).tolist()) for row, f in pairs]
    assert got == expected  # both keep every tie at a cut
    tokens = race_rows(logits, inv_temp, torch.arange(rows), floors)
    assert all(bool(row[t] >= f) for row, t, f in zip(tempered, tokens, floors, strict=True))


def test_top_cut_special_rows() -> None:
    inf = float("inf")
    logits = torch.zeros(4, 3000)
    logits[0] = -inf  # nothing to cut
    logits[1, 5] = float("nan")  # NaN never kept; the rest tied: every tie kept
    logits[2, :10] = 1.0  # top_k 3 inside ten ties: all ten kept
    logits[3, 7] = 100.0  # all the mass on one token
    floors = top_cut(
        logits,
        torch.ones(4),
        torch.tensor([0, 0, 3, 0]),
        torch.tensor([0.5, 0.5, 1.0, 0.999]),
        torch.zeros(4),
    )
    assert floors[0] == -inf
    assert int((logits[1] >= floors[1]).sum()) == 2999
    assert set((logits[2] >= floors[2]).nonzero().squeeze(1).tolist()) == set(range(10))
    assert (logits[3] >= floors[3]).nonzero().squeeze(1).tolist() == [7]


def assert_logprobs_match_torch(x: torch.Tensor, tokens: torch.Tensor, k: int) -> None:
    """The kernel against a float32 log_softmax, a rank count over the logits and a stable
    descending sort (ties: the smaller id first)."""
    got = logprob_rows(x, tokens, k)
    reference = x.float().log_softmax(dim=-1)  # [rows, n]
    picked = tokens.unsqueeze(1)
    expected = reference.gather(1, picked).squeeze(1)
    assert torch.allclose(got.token_logprob, expected, atol=2e-5, rtol=1e-6)
    assert torch.equal(got.token_rank, (x > x.gather(1, picked)).sum(dim=-1) + 1)
    top = reference.sort(dim=-1, descending=True, stable=True)
    assert torch.equal(got.top_ids, top.indices[:, :k])
    assert torch.allclose(got.top_logprobs, top.values[:, :k], atol=2e-5, rtol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("rows", "n", "k"),
    [(1, 1, 1), (3, 15, 0), (5, 16, 16), (7, 17, 5), (40, 1000, 20), (3, 49157, 64)],
)
def test_logprob_rows_match_log_softmax_rank_and_sorted_top(
    dtype: torch.dtype, rows: int, n: int, k: int
) -> None:
    generator = torch.Generator().manual_seed(rows + n)
    tokens = torch.randint(0, n, (rows,), generator=generator)
    spread = randn(rows, n + 3, dtype=dtype, seed=n)[:, 3:] * 3  # rows strided, unaligned
    assert fused_supported(spread)
    assert_logprobs_match_torch(spread, tokens, k)
    ties = torch.randint(-4, 4, (rows, n), generator=generator).to(dtype)  # few values
    assert_logprobs_match_torch(ties, tokens, k)
    broadcast = spread[:1].expand(rows, -1)  # one row read `rows` times (row stride 0)
    assert_logprobs_match_torch(broadcast, tokens, k)


def test_logprob_rows_special_rows() -> None:
    inf, nan = float("inf"), float("nan")
    x = torch.zeros(4, 40)
    x[0, 3] = nan  # NaN: NaN logprobs, as log_softmax; top ids 0 .. k-1
    x[1] = -inf
    x[1, 30] = 2.0  # one finite token: logprob 0, the -inf ones -inf
    x[2, 39] = 50.0  # in the tail, after the vector lanes
    x[3] = torch.arange(40.0)
    got = logprob_rows(x, torch.tensor([3, 5, 0, 39]), 3)
    assert bool(got.token_logprob[0].isnan()) and bool(got.top_logprobs[0].isnan().all())
    assert got.top_ids[0].tolist() == [0, 1, 2]  # ties: the smaller id first, NaN skipped
    assert got.token_logprob[1] == -inf and got.token_rank[1] == 2
    assert got.top_ids[1].tolist() == [30, 0, 1] and got.top_logprobs[1].tolist() == [
        0.0,
        -inf,
        -inf,
    ]
    assert got.top_ids[2, 0] == 39 and got.token_rank[2] == 2
    assert got.top_ids[3].tolist() == [39, 38, 37] and got.token_rank[3] == 1
    reference = x[3].log_softmax(dim=-1)
    assert torch.allclose(got.top_logprobs[3], reference[[39, 38, 37]])


def test_logprob_rows_refuse_a_token_outside_the_row() -> None:
    with pytest.raises(RuntimeError, match="rejected"):
        logprob_rows(torch.zeros(2, 10), torch.tensor([0, 10]), 1)
