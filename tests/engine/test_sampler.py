"""Sampler behaviour: greedy, filters, penalties, min_tokens, seeds and logprobs."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvmesh.engine.sampler import (
    Sampler,
    SamplingBatch,
    SamplingRow,
    apply_top_k_top_p,
    penalize_,
)
from kvmesh.engine.sampling_params import SamplingParams

VOCAB = 64
EOS = 7


def random_logits(rows: int, seed: int, vocab: int = VOCAB) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3  # [rows, V]


def row(
    params: SamplingParams, output: tuple[int, ...] = (), prompt: tuple[int, ...] = (1, 2), **kw
) -> SamplingRow:
    return SamplingRow(params=params, prompt_ids=prompt, output_ids=output, **kw)


def sample(logits: torch.Tensor, rows: list[SamplingRow], seed: int = 0, eos: int | None = EOS):
    sampler = Sampler(torch.Generator().manual_seed(seed))
    return sampler(logits, SamplingBatch.build(rows, eos_token_id=eos))


def draws(logits_row: torch.Tensor, params: SamplingParams, count: int) -> Counter[int]:
    """`count` independent draws of one row, as one batch of identical unseeded rows."""
    logits = logits_row.unsqueeze(0).expand(count, -1).contiguous()  # [count, V]
    out = sample(logits, [row(params)] * count, seed=3)
    return Counter(out.token_ids.tolist())


def test_greedy_is_argmax() -> None:
    logits = random_logits(5, seed=1)
    out = sample(logits, [row(SamplingParams(temperature=0.0))] * 5)
    assert out.token_ids.dtype == torch.int64
    assert torch.equal(out.token_ids, logits.argmax(dim=-1))
    assert out.logprobs == [None] * 5


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_greedy_of_16_bit_logits_is_the_argmax_of_their_float32_values(dtype) -> None:
    """Plain greedy rows take the argmax of 16-bit logits as they are (ties included: few
    distinct values); rows that need float32 (logprobs, min_tokens) still get it."""
    logits = (random_logits(40, seed=4, vocab=5000) / 2).round().to(dtype)  # many ties
    widened = logits.float()
    out = sample(logits, [row(SamplingParams(temperature=0.0))] * 40)
    assert torch.equal(out.token_ids, widened.max(dim=-1).indices)
    asks = row(SamplingParams(temperature=0.0, logprobs=2))
    masked = row(SamplingParams(temperature=0.0, min_tokens=1, stop_token_ids=[9]))
    out = sample(logits[:2], [asks, masked])
    expected = sample(widened[:2], [asks, masked])
    assert torch.equal(out.token_ids, expected.token_ids)
    assert out.logprobs == expected.logprobs and out.logprobs[0] is not None


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(top_k=1),
        SamplingParams(top_p=1e-6),
        SamplingParams(temperature=1e-4),
        SamplingParams(min_p=1.0),
        SamplingParams(temperature=2.0, top_k=1, seed=5),
    ],
    ids=["top_k=1", "tiny top_p", "tiny temperature", "min_p=1", "seeded top_k=1"],
)
def test_degenerate_filters_equal_greedy(params: SamplingParams) -> None:
    logits = random_logits(8, seed=2)
    out = sample(logits, [row(params)] * 8)
    assert torch.equal(out.token_ids, logits.argmax(dim=-1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_plain_sampling_follows_the_distribution(dtype: torch.dtype) -> None:
    """float32 and bfloat16 race in the CPU kernel, float16 in torch."""
    logits = torch.log(torch.tensor([0.6, 0.3, 0.1])).to(dtype)
    counts = draws(logits, SamplingParams(), 4000)
    for token, p in enumerate([0.6, 0.3, 0.1]):
        assert abs(counts[token] / 4000 - p) < 0.03


def test_temperature_sharpens_and_flattens() -> None:
    logits = torch.log(torch.tensor([0.6, 0.3, 0.1]))
    cold = draws(logits, SamplingParams(temperature=0.25), 2000)
    hot = draws(logits, SamplingParams(temperature=4.0), 2000)
    assert cold[0] / 2000 > 0.9  # 0.6^4 / (0.6^4 + 0.3^4 + 0.1^4) ~ 0.94
    assert 0.2 < hot[2] / 2000 < 0.35  # close to uniform


def test_top_k_and_top_p_and_min_p_restrict_the_support() -> None:
    probs = torch.tensor([0.4, 0.3, 0.2, 0.06, 0.04])
    logits = torch.log(probs)
    assert set(draws(logits, SamplingParams(top_k=2), 1000)) == {0, 1}
    assert set(draws(logits, SamplingParams(top_p=0.85), 1000)) == {0, 1, 2}
    assert set(draws(logits, SamplingParams(top_p=0.7), 1000)) == {0, 1}
    # min_p 0.45: keep p >= 0.18 -> {0, 1, 2}; 0.6: keep p >= 0.24 -> {0, 1}
    assert set(draws(logits, SamplingParams(min_p=0.45), 1000)) == {0, 1, 2}
    assert set(draws(logits, SamplingParams(min_p=0.6), 1000)) == {0, 1}
    assert len(draws(logits, SamplingParams(top_k=-1), 1000)) == 5


def test_filters_only_touch_their_own_row() -> None:
    logits = torch.log(torch.tensor([[0.4, 0.3, 0.3]] * 600))
    rows = [row(SamplingParams(top_k=1)), row(SamplingParams())] * 300
    out = sample(logits, rows).token_ids.view(300, 2)
    assert set(out[:, 0].tolist()) == {0}
    assert set(out[:, 1].tolist()) == {0, 1, 2}


@pytest.mark.parametrize(
    ("logits", "params", "prompt", "output", "expected"),
    [
        ([2.0, 1.9], SamplingParams(temperature=0, repetition_penalty=1.2), (5,), (0,), 1),
        ([2.0, 1.9], SamplingParams(temperature=0, repetition_penalty=1.2), (0,), (), 1),
        ([-1.0, -1.1], SamplingParams(temperature=0, repetition_penalty=1.2), (0,), (), 1),
        ([2.0, 1.9], SamplingParams(temperature=0, repetition_penalty=1.01), (0,), (), 0),
        ([1.0, 0.9], SamplingParams(temperature=0, presence_penalty=0.2), (5,), (0,), 1),
        ([1.0, 0.9], SamplingParams(temperature=0, presence_penalty=0.2), (0,), (), 0),
        ([1.0, 0.9], SamplingParams(temperature=0, frequency_penalty=0.06), (5,), (0, 0), 1),
        ([1.0, 0.9], SamplingParams(temperature=0, frequency_penalty=0.06), (5,), (0,), 0),
        ([1.0, 0.9], SamplingParams(temperature=0, presence_penalty=-0.5), (5,), (1,), 1),
    ],
)
def test_penalties_change_the_choice(logits, params, prompt, output, expected) -> None:
    full = torch.full((1, 8), -5.0)
    full[0, :2] = torch.tensor(logits)
    out = sample(full, [row(params, output=output, prompt=prompt)], eos=None)
    assert out.token_ids.tolist() == [expected]


def test_penalties_apply_per_row() -> None:
    full = torch.full((2, 8), -5.0)
    full[:, :2] = torch.tensor([2.0, 1.9])
    rows = [
        row(SamplingParams(temperature=0, repetition_penalty=1.5), output=(0,), prompt=(5,)),
        row(SamplingParams(temperature=0), output=(0,), prompt=(5,)),
    ]
    assert sample(full, rows).token_ids.tolist() == [1, 0]


def test_min_tokens_masks_eos_and_stop_ids_until_reached() -> None:
    logits = torch.zeros(1, VOCAB)
    logits[0, EOS], logits[0, 9], logits[0, 3] = 5.0, 4.0, 3.0
    greedy = SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[9])
    assert sample(logits, [row(greedy, output=(1,))]).token_ids.tolist() == [3]
    assert sample(logits, [row(greedy, output=(1, 1))]).token_ids.tolist() == [EOS]
    ignore = SamplingParams(temperature=0, min_tokens=2, ignore_eos=True)
    assert sample(logits, [row(ignore, output=())]).token_ids.tolist() == [EOS]
    per_row_eos = row(SamplingParams(temperature=0, min_tokens=1), eos_token_id=9)
    assert sample(logits, [per_row_eos], eos=None).token_ids.tolist() == [EOS]
    assert sample(
        logits, [row(SamplingParams(temperature=0, min_tokens=1))]
    ).token_ids.tolist() == [9]


def seeded_run(
    seed: int, position: int, others: list[SamplingParams], steps: int = 12
) -> list[int]:
    """Tokens of one seeded row over `steps` steps, placed at `position` among `others`."""
    tokens: list[int] = []
    for step in range(steps):
        target = random_logits(1, seed=100 + step)
        batch_logits = random_logits(len(others) + 1, seed=1000 + step + len(others))
        batch_logits[position] = target[0]
        rows = [row(p, output=(0,) * step) for p in others]
        rows.insert(position, row(SamplingParams(seed=seed, top_p=0.95), output=tuple(tokens)))
        out = sample(batch_logits, rows, seed=step * 7 + len(others))
        tokens.append(int(out.token_ids[position]))
    return tokens


def test_seeded_rows_are_independent_of_the_batch() -> None:
    alone = seeded_run(42, 0, [])
    mixed = [SamplingParams(), SamplingParams(seed=1), SamplingParams(temperature=0)]
    assert seeded_run(42, 2, mixed) == alone
    assert seeded_run(42, 1, mixed[:1] * 5) == alone
    assert len(set(alone)) > 3
    assert seeded_run(43, 0, []) != alone


def test_seeded_draw_is_keyed_on_step_and_child_index() -> None:
    logits = random_logits(1, seed=9)
    params, other = SamplingParams(seed=7), SamplingParams(seed=8)
    by_step = [
        sample(logits, [row(params, step_seed_offset=s)]).token_ids.item() for s in range(30)
    ]
    assert len(set(by_step)) > 5
    again = [sample(logits, [row(params, output=(0,) * s)]).token_ids.item() for s in range(30)]
    assert again == by_step
    child = [
        sample(logits, [row(params, step_seed_offset=s, sample_index=1)]).token_ids.item()
        for s in range(30)
    ]
    sibling = [sample(logits, [row(other, step_seed_offset=s)]).token_ids.item() for s in range(30)]
    assert child == sibling != by_step


def test_unseeded_rows_follow_the_global_generator() -> None:
    logits = random_logits(16, seed=4)
    rows = [row(SamplingParams())] * 16
    assert torch.equal(
        sample(logits, rows, seed=1).token_ids, sample(logits, rows, seed=1).token_ids
    )
    assert not torch.equal(
        sample(logits, rows, seed=1).token_ids, sample(logits, rows, seed=2).token_ids
    )


def test_logprobs_are_raw_sorted_and_consistent() -> None:
    logits = random_logits(3, seed=5)
    rows = [
        row(SamplingParams(logprobs=5, temperature=0.7, repetition_penalty=1.3), output=(4, 5)),
        row(SamplingParams(temperature=0)),
        row(SamplingParams(logprobs=0, temperature=0)),
    ]
    out = sample(logits, rows)
    reference = logits.log_softmax(dim=-1)
    first, none, zero = out.logprobs
    assert none is None and zero is not None and first is not None
    assert first.top_token_ids == tuple(reference[0].topk(5).indices.tolist())
    assert list(first.top_logprobs) == sorted(first.top_logprobs, reverse=True)
    assert first.top_logprobs == pytest.approx(reference[0].topk(5).values.tolist())
    assert first.sampled_token_id == int(out.token_ids[0])
    assert first.sampled_logprob == pytest.approx(float(reference[0, first.sampled_token_id]))
    assert (
        first.sampled_rank == int((reference[0] > reference[0, first.sampled_token_id]).sum()) + 1
    )
    assert zero.top_token_ids == () and zero.sampled_rank == 1
    assert zero.sampled_logprob == pytest.approx(float(reference[2].max()))


def allowed_tokens(logits: torch.Tensor, params: SamplingParams) -> set[int]:
    """Reference support of one row, one token at a time: temperature, min_p, top_k, top_p."""
    probs = (logits / params.temperature).softmax(dim=-1).tolist()
    keep = {i for i, p in enumerate(probs) if p >= params.min_p * max(probs)}
    by_prob = sorted(keep, key=lambda i: -probs[i])
    if params.top_k > 0:
        keep = {i for i in keep if probs[i] >= probs[by_prob[min(params.top_k, len(by_prob)) - 1]]}
    mass = sum(probs[i] for i in keep)
    kept, total = set(), 0.0
    for i in sorted(keep, key=lambda i: -probs[i]):
        kept.add(i)
        total += probs[i] / mass
        if total >= params.top_p - 1e-6:
            break
    return kept


@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    temperature=st.sampled_from([0.5, 1.0, 1.7]),
    top_k=st.sampled_from([0, 1, 3, 10]),
    top_p=st.sampled_from([1.0, 0.9, 0.5, 0.2]),
    min_p=st.sampled_from([0.0, 0.05, 0.3]),
)
def test_samples_stay_inside_the_combined_support(seed, temperature, top_k, top_p, min_p) -> None:
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    logits = random_logits(1, seed=seed, vocab=16)[0]
    support = allowed_tokens(logits, params)
    seen = set(draws(logits, params, 300))
    assert seen <= support
    assert logits.argmax().item() in seen


def kept(logits: torch.Tensor) -> list[set[int]]:
    return [set(torch.isfinite(row).nonzero().squeeze(1).tolist()) for row in logits]


def test_top_k_keeps_every_tie_at_the_cut() -> None:
    logits = torch.zeros(2, 5000)
    logits[:, :3] = 2.0  # three ahead, then 4997 tied: top_k=4 keeps every tie
    logits[1, 4000] = 1.0
    got = apply_top_k_top_p(logits, torch.tensor([4, 4]), None)
    assert kept(got)[0] == set(range(5000))
    assert kept(got)[1] == {0, 1, 2, 4000}


def dense_penalties(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """vLLM's penalties over dense [rows, vocab] counts: the reference."""
    counts = torch.zeros_like(logits)
    seen = torch.zeros(logits.shape, dtype=torch.bool)
    for i, r in enumerate(rows):
        if r.params.has_penalties:
            counts[i].index_add_(0, torch.tensor(r.output_ids, dtype=torch.int64),
                                 torch.ones(len(r.output_ids)))  # fmt: skip
            seen[i, list(r.prompt_ids)] = True
    seen |= counts > 0
    column = lambda name: torch.tensor([getattr(r.params, name) for r in rows]).unsqueeze(1)  # noqa: E731
    penalty = torch.where(seen, column("repetition_penalty"), torch.ones(1))
    out = torch.where(logits > 0, logits / penalty, logits * penalty)
    return out - column("frequency_penalty") * counts - column("presence_penalty") * (counts > 0)


def test_penalties_at_seen_tokens_equal_the_dense_formula() -> None:
    rng = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 5000, generator=rng) * 3
    params = [
        SamplingParams(repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=-0.2),
        SamplingParams(),  # no penalties: untouched
        SamplingParams(repetition_penalty=0.8),
        SamplingParams(frequency_penalty=-0.7),
        SamplingParams(presence_penalty=1.5, repetition_penalty=1.1),
        SamplingParams(frequency_penalty=0.1),
    ]
    rows = [
        row(p, output=tuple(torch.randint(0, 5000, (n,), generator=rng).tolist()),
            prompt=tuple(torch.randint(0, 5000, (m,), generator=rng).tolist()))
        for p, n, m in zip(params, [300, 50, 0, 900, 20, 1], [400, 10, 700, 0, 5, 1], strict=True)
    ]  # fmt: skip
    got = logits.clone()
    penalize_(got, rows)
    assert torch.equal(got, dense_penalties(logits, rows))
    assert torch.equal(got[1], logits[1])


def test_ties_at_the_top_p_cut_are_kept_on_both_paths() -> None:
    """0.4 then three tokens of 0.2 each: top_p 0.5 needs the second token, so every token tied
    with it stays, in the CPU kernel (float32) and in torch (float16) alike."""
    probs = torch.full((100,), 1e-9)
    probs[0], probs[1:4] = 0.4, 0.2
    logits = probs.log()
    params = SamplingParams(top_p=0.5)
    assert set(draws(logits, params, 2000)) == {0, 1, 2, 3}
    assert set(draws(logits.half(), params, 2000)) == {0, 1, 2, 3}
    assert kept(apply_top_k_top_p(logits[None], None, torch.tensor([0.5])))[0] == {0, 1, 2, 3}


def test_penalties_refuse_a_token_outside_the_vocabulary() -> None:
    rows = [row(SamplingParams(repetition_penalty=1.2), output=(8,)), row(SamplingParams())]
    with pytest.raises(ValueError, match="outside the vocabulary"):
        penalize_(torch.zeros(2, 8), rows)


def test_raw_logprobs_torch_path_gives_the_kernels_ids_and_ranks() -> None:
    """The torch path (float16 rows here; CUDA) against the CPU kernel on the same values in
    float32: runs of ties, -inf tails, and rows whose log_softmax is NaN (a NaN, +inf, all
    -inf: ids 0 .. k-1)."""
    from kvmesh.engine.sampler import raw_logprobs

    inf = float("inf")
    generator = torch.Generator().manual_seed(8)
    x = torch.randn(7, 300, generator=generator)
    x[0] = 10 + torch.arange(300) * 2**-10  # runs of ties once rounded to float16
    x[1] = (x[1] * 2).round()  # ties
    x[2, 7] = float("nan")
    x[3, 11] = inf
    x[4] = -inf
    x[5, 100:] = -inf
    x16 = x.half()
    tokens = torch.tensor([5, 9, 0, 1, 2, 150, 299])
    kernel = raw_logprobs(x16.float(), tokens, 20)  # float32 on CPU: the kernel
    torch_path = raw_logprobs(x16, tokens, 20)  # float16: torch
    assert torch.equal(kernel.top_ids, torch_path.top_ids)
    assert torch.equal(kernel.token_rank, torch_path.token_rank)
    assert torch.allclose(kernel.top_logprobs, torch_path.top_logprobs, atol=1e-5, equal_nan=True)
    assert bool(kernel.top_logprobs[2:5].isnan().all())
    assert kernel.top_ids[4].tolist() == list(range(20))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_logit_bias_forces_bans_and_leaves_raw_logprobs(dtype: torch.dtype) -> None:
    """+100 makes a token win, -100 removes the argmax; a row without a bias is untouched;
    logprobs stay those of the raw logits."""
    logits = random_logits(4, seed=11).to(dtype)
    top = logits.float().argmax(dim=-1)
    forced = int(logits[0].float().argmin())  # the least likely token
    rows = [
        row(SamplingParams(temperature=0, logit_bias={forced: 100.0}, logprobs=1)),
        row(SamplingParams(temperature=0, logit_bias={int(top[1]): -100.0})),
        row(SamplingParams(temperature=0)),
        row(SamplingParams(temperature=1.0, seed=5, logit_bias={forced: 100.0})),
    ]
    out = sample(logits, rows)
    assert int(out.token_ids[0]) == forced and int(out.token_ids[3]) == forced
    second = logits[1].float().clone()
    second[top[1]] = float("-inf")
    assert int(out.token_ids[1]) == int(second.argmax())
    assert int(out.token_ids[2]) == int(top[2])
    lp = out.logprobs[0]
    assert lp is not None and lp.sampled_token_id == forced
    raw = logits[0].float().log_softmax(dim=-1)
    assert lp.sampled_logprob == pytest.approx(float(raw[forced]), abs=1e-4)
    assert lp.top_token_ids == (int(top[0]),)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        sample(logits, [row(SamplingParams(logit_bias={VOCAB: 1.0}))] * 4)


def test_a_sampler_reusing_its_buffer_draws_what_fresh_samplers_draw() -> None:
    """Calls of different shapes and dtypes through one sampler (its processed-logits buffer
    kept between calls) give the tokens fresh samplers give."""
    biased = SamplingParams(temperature=0, logit_bias={3: 5.0}, presence_penalty=1.0)
    calls = [
        (random_logits(6, seed=21).bfloat16(), [row(biased, output=(4, 4))] * 6),
        (random_logits(2, seed=22), [row(SamplingParams(temperature=0, logit_bias={8: 3.0}))] * 2),
        (random_logits(9, seed=23).bfloat16(), [row(biased, output=(1,))] * 9),
    ]
    shared = Sampler(torch.Generator().manual_seed(0))
    for logits, rows in calls * 2:
        batch = SamplingBatch.build(rows, eos_token_id=EOS)
        expected = Sampler(torch.Generator().manual_seed(0))(logits, batch).token_ids
        assert torch.equal(shared(logits, batch).token_ids, expected)
