"""Vectorised token sampler: one call turns a `[rows, vocab]` logits batch into one token per row.

Order of operations (vLLM v1's):

1. logprobs: `log_softmax` of the RAW model logits (before any processing, vLLM's default),
   taken after the draw from the rows as the model gave them (on CPU one kernel,
   `cpu_fused.logprob_rows`: the sampled token's logprob and rank and the top-n without a
   float32 copy of the rows);
2. min_tokens: every EOS id (unless ignore_eos) and stop_token_ids masked while output is too
   short;
   then logit_bias added to its tokens' logits;
3. penalties: repetition (divide positive / multiply negative logits of tokens seen in prompt or
   output), then frequency (minus count in output) and presence (minus 1 if in output);
4. greedy rows take the argmax here; the others: temperature, min_p, top_k, top_p, then draw.

Drawing is an exponential race: `argmax(probs / q)` with `q ~ Exp(1)` per vocabulary entry picks
token i with probability probs[i]; in log space it is the Gumbel-max race `argmax(logits / T +
g)`, `g = -log(-log(u))`, which the CPU kernel (`cpu_fused.race_rows`) runs in one pass over the
logits with uniforms from a counter-based generator keyed per row; min_p, top_k and top_p
become one smallest kept tempered value per row (`cpu_fused.top_cut`: a histogram of the row
and a sort of the one bucket holding each cut, not a sort of the vocabulary), below which the
race skips values. A seeded row's key is
`mix(seed + sample_index, step)`, so its tokens depend only on its own seed, child index and
step, never on the batch it shares; unseeded rows' keys come from the sampler's generator.
Elsewhere (CUDA, float16) the race runs in torch, with per-row generators for seeded rows; the
path follows the model's logits, not the batch (float16 rows widened to float32 because another
row has a penalty or a logit_bias still race in torch).
"""

from __future__ import annotations

import functools
from collections.abc import Collection, Sequence
from dataclasses import dataclass

import torch
from kvmesh_kernels.cpu_fused import (
    Logprobs,
    argmax_rows,
    fused_supported,
    logprob_rows,
    race_rows,
    top_cut,
)

from kvmesh.engine.logprobs import TokenLogprobs
from kvmesh.engine.sampling_params import SamplingParams

_MASK64 = (1 << 64) - 1
_MASK63 = (1 << 63) - 1
_FLOAT32 = torch.finfo(torch.float32)  # the sampler's arithmetic: values stay in its range


def mix_seed(seed: int, step: int) -> int:
    """A well-spread 63-bit generator seed from a request seed and a step (splitmix64)."""
    x = (seed * 0x9E3779B97F4A7C15 + step + 0x632BE59BD9B4E019) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (x ^ (x >> 31)) >> 1


@dataclass(frozen=True)
class SamplingRow:
    """One logits row to sample from and the history its penalties and stops look at.

    step_seed_offset: the step a seeded row's draw is keyed on (default: len(output_ids), which
    stays right across preemption and recompute). sample_index: child number for n > 1, so each
    child of a seeded request draws like a request with seed `seed + sample_index` (vLLM).
    eos_token_id: overrides the batch-wide EOS ids for this row.
    """

    params: SamplingParams
    prompt_ids: Sequence[int]
    output_ids: Sequence[int]
    step_seed_offset: int | None = None
    sample_index: int = 0
    eos_token_id: int | None = None

    @property
    def step(self) -> int:
        return len(self.output_ids) if self.step_seed_offset is None else self.step_seed_offset


@dataclass(frozen=True)
class SamplingBatch:
    """Per-row sampling tensors (CPU) plus the rows themselves; build with `SamplingBatch.build`."""

    rows: tuple[SamplingRow, ...]
    temperature: torch.Tensor  # [rows] float32, 1.0 for greedy rows
    top_k: torch.Tensor  # [rows] int64, 0 = off
    top_p: torch.Tensor  # [rows] float32
    min_p: torch.Tensor  # [rows] float32
    greedy: torch.Tensor  # [rows] bool
    stop_masks: tuple[tuple[int, ...], ...]  # per row: ids masked until min_tokens is reached
    all_greedy: bool
    any_penalties: bool
    any_logit_bias: bool
    any_top_k: bool
    any_top_p: bool
    any_min_p: bool
    max_logprobs: int | None  # largest top-n asked for, None if no row wants logprobs

    @classmethod
    def build(
        cls, rows: Sequence[SamplingRow], eos_token_id: int | Collection[int] | None = None
    ) -> SamplingBatch:
        """Collect the per-row parameters of `rows` (in order) into batch tensors.
        eos_token_id: the model's EOS id, or all of them (each masked until min_tokens)."""
        rows = tuple(rows)
        eos = () if eos_token_id is None else _as_ids(eos_token_id)
        params = [row.params for row in rows]
        greedy = [p.greedy for p in params]
        asked = [p.logprobs for p in params if p.logprobs is not None]
        return cls(
            rows=rows,
            temperature=torch.tensor(  # a temperature beyond float32's range is its largest
                [
                    1.0 if g else min(p.temperature, _FLOAT32.max)
                    for p, g in zip(params, greedy, strict=True)
                ],
                dtype=torch.float32,
            ),
            top_k=torch.tensor([max(p.top_k, 0) for p in params], dtype=torch.int64),
            top_p=torch.tensor([p.top_p for p in params], dtype=torch.float32),
            min_p=torch.tensor([p.min_p for p in params], dtype=torch.float32),
            greedy=torch.tensor(greedy, dtype=torch.bool),
            stop_masks=tuple(_stop_mask(row, eos) for row in rows),
            all_greedy=all(greedy),
            any_penalties=any(p.has_penalties for p in params),
            any_logit_bias=any(p.logit_bias for p in params),
            any_top_k=any(p.top_k > 0 for p in params),
            any_top_p=any(p.top_p < 1.0 for p in params),
            any_min_p=any(p.min_p > 0.0 for p in params),
            max_logprobs=max(asked) if asked else None,
        )

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def plain_greedy(self) -> bool:
        """Every row greedy with no logprobs, penalties, logit biases or min_tokens masks: the
        argmax of the raw logits is the whole answer."""
        return (
            self.all_greedy
            and self.max_logprobs is None
            and not self.any_penalties
            and not self.any_logit_bias
            and not any(self.stop_masks)
        )


def _as_ids(eos: int | Collection[int]) -> tuple[int, ...]:
    return (eos,) if isinstance(eos, int) else tuple(eos)


def _stop_mask(row: SamplingRow, default_eos: tuple[int, ...]) -> tuple[int, ...]:
    """The ids a row masks while it has fewer than min_tokens outputs: its stop_token_ids, then
    every EOS id (the row's own, else the batch's) unless ignore_eos."""
    params = row.params
    if len(row.output_ids) >= params.min_tokens:
        return ()
    ids = list(params.stop_token_ids)
    if not params.ignore_eos:
        ids.extend(default_eos if row.eos_token_id is None else (row.eos_token_id,))
    return tuple(ids)


@dataclass(frozen=True)
class SamplerOutput:
    token_ids: torch.Tensor  # [rows] int64
    logprobs: list[TokenLogprobs | None]  # per row; None where the row asked for none


class Sampler:
    """Samples one token per row. Holds the global generator used by rows without a seed and
    the buffer its processed logits are copied into (one call at a time per sampler)."""

    def __init__(self, generator: torch.Generator | None = None) -> None:
        self.generator = generator
        self._scratch: torch.Tensor | None = None  # flat buffer of the processed logits' copy

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        """logits: [rows, vocab] in float32 or the model's 16-bit dtype, row i belonging to
        batch.rows[i]. Greedy rows with nothing to apply take the argmax of the logits as they
        are (a 16-bit value widens to float32 exactly: the same token); anything else
        computes in float32."""
        assert logits.dim() == 2 and logits.shape[0] == len(batch), "one logits row per row"
        if batch.plain_greedy:
            return SamplerOutput(token_ids=greedy_ids(logits), logprobs=[None] * len(batch))
        processed = self._process(logits, batch)  # a copy where anything applies
        if batch.all_greedy:
            token_ids = greedy_ids(processed)
        else:  # the draw path follows the model's logits, never what the batch widened them to
            token_ids = self._sample(processed, batch, fused=fused_supported(logits))
        if batch.max_logprobs is None:
            return SamplerOutput(token_ids=token_ids, logprobs=[None] * len(batch))
        asked = [i for i, row in enumerate(batch.rows) if row.params.logprobs is not None]
        rows_asked = logits if len(asked) == len(batch) else logits[asked]  # raw logits
        raw = raw_logprobs(rows_asked, token_ids[asked], batch.max_logprobs)
        return SamplerOutput(token_ids, _logprobs_per_row(raw, token_ids, batch, asked))

    def _process(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """min_tokens masking, logit biases and penalties, on one copy of the logits made only
        when something applies (float32 for biases and penalties, else the logits' dtype: the
        kernels read 16-bit rows as they are, and widening is exact)."""
        arithmetic = batch.any_penalties or batch.any_logit_bias
        if not (arithmetic or any(batch.stop_masks)):
            return logits
        widen = arithmetic and logits.dtype != torch.float32  # masks alone: -inf fits
        logits = self._copy(logits, torch.float32 if widen else logits.dtype)
        for i, ids in enumerate(batch.stop_masks):
            if ids:
                logits[i, list(ids)] = float("-inf")
        if batch.any_logit_bias:
            add_logit_bias_(logits, batch.rows)
        if batch.any_penalties:
            penalize_(logits, batch.rows)
        return logits

    def _copy(self, logits: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """A contiguous copy of logits [rows, vocab] in `dtype`, in a buffer this sampler keeps
        (valid until its next call) instead of a fresh tensor per step, whose pages are faulted
        in anew each time (BENCHMARKS.md "Sampling (CPU)")."""
        need = logits.numel()
        scratch = self._scratch
        if (
            scratch is None
            or scratch.numel() < need
            or scratch.dtype != dtype
            or scratch.device != logits.device
        ):
            scratch = self._scratch = torch.empty(need, dtype=dtype, device=logits.device)
        out = scratch[:need].view(logits.shape)  # [rows, vocab]
        out.copy_(logits)
        return out

    def _sample(self, logits: torch.Tensor, batch: SamplingBatch, fused: bool) -> torch.Tensor:
        """One token per row of the processed logits. `fused`: race in the CPU kernel (decided
        from the model's logits by the caller: a float16 batch widened to float32 because one
        row has a penalty still races in torch, so a seeded row draws the same whatever its
        batch holds); else the torch race. A top_k beyond the vocabulary is off (0)."""
        untempered = logits  # the greedy rows' argmax reads these
        device = logits.device
        temperature = batch.temperature.to(device)  # [rows], 1.0 for greedy rows
        filtered = batch.any_min_p or batch.any_top_k or batch.any_top_p
        top_k = batch.top_k.masked_fill(batch.top_k > logits.shape[1], 0)  # [rows], 0 = off
        if fused:  # filters and draw in two passes over the raw logits
            inv_temp = temperature.reciprocal()
            floors = None
            if filtered:
                floors = top_cut(logits, inv_temp, top_k, batch.top_p, batch.min_p)
            sampled = race_rows(logits, inv_temp, self._keys(batch), floors)  # [rows]
        else:  # a penalised +huge value divided by a temperature < 1 stays finite (no NaN row)
            logits = (logits.float() / temperature.unsqueeze(1)).clamp_(max=_FLOAT32.max)
            if batch.any_min_p:
                logits = apply_min_p(logits, batch.min_p.to(device))
            if batch.any_top_k or batch.any_top_p:
                top_p = batch.top_p.to(device) if batch.any_top_p else None
                logits = apply_top_k_top_p(
                    logits, top_k.to(device) if batch.any_top_k else None, top_p
                )
            probs = logits.softmax(dim=-1)  # [rows, vocab]
            sampled = greedy_ids(probs.div_(self._exponentials(probs, batch)))  # [rows]
        if not bool(batch.greedy.any()):
            return sampled
        return torch.where(batch.greedy.to(device), greedy_ids(untempered), sampled)

    def _keys(self, batch: SamplingBatch) -> torch.Tensor:
        """int64 [rows] race keys: a seeded row's from its seed, child index and step (its
        draw depends on nothing else), the others drawn from the sampler's generator."""
        keys = torch.randint(0, _MASK63, (len(batch),), generator=self.generator)
        for i, row in enumerate(batch.rows):
            if row.params.seed is not None:
                seed = (row.params.seed + row.sample_index) & _MASK64
                keys[i] = mix_seed(seed, row.step)
        return keys

    def _exponentials(self, probs: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """[rows, vocab] Exp(1) draws: per-row generators for seeded rows, global for the rest."""
        race = torch.empty_like(probs)
        seeded = [i for i, row in enumerate(batch.rows) if row.params.seed is not None]
        if len(seeded) < len(batch):
            race.exponential_(generator=self.generator)
        for i in seeded:
            row = batch.rows[i]
            assert row.params.seed is not None
            gen = torch.Generator(device=probs.device)
            gen.manual_seed(mix_seed((row.params.seed + row.sample_index) & _MASK64, row.step))
            race[i].exponential_(generator=gen)
        return race


def greedy_ids(logits: torch.Tensor) -> torch.Tensor:
    """Most likely token per row of logits [rows, vocab] -> [rows] int64, the first on ties
    (a row holding NaN: its first NaN).

    Same result as `argmax(dim=-1)`. On CPU the fused kernel (`cpu_fused.argmax_rows`: one pass
    that keeps each vector lane's maximum and its index) where it applies, else `max(dim=-1)`,
    which measured 2.5-3x faster than argmax on CPU for a 32k vocabulary
    (`bench/micro_choices.py`).
    """
    if logits.shape[-1] > 0 and fused_supported(logits):
        return argmax_rows(logits)
    return logits.max(dim=-1).indices


def add_logit_bias_(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
    """Add each row's logit_bias to its tokens' logits, in place on contiguous float32 logits
    [rows, vocab]: one indexed add for the batch, from per-request tensors built once
    (`_bias_tensors`); ValueError for a token outside the vocabulary."""
    vocab = logits.shape[1]
    positions, values = [], []
    for i, row in enumerate(rows):
        pairs = row.params.logit_bias_pairs
        if not pairs:
            continue
        if pairs[-1][0] >= vocab:  # pairs are sorted by id
            raise ValueError(f"a token id outside the vocabulary of {vocab}")
        ids, biases = _bias_tensors(pairs)
        positions.append(ids + i * vocab)
        values.append(biases)
    flat = torch.cat(positions).to(logits.device)  # [biased entries] flat positions
    logits.view(-1).index_add_(0, flat, torch.cat(values).to(logits.device))


@functools.lru_cache(maxsize=1024)
def _bias_tensors(pairs: tuple[tuple[int, float], ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """A logit_bias's token ids (int64) and biases (float32), built once per distinct bias
    (a request's every step reuses them)."""
    ids = torch.tensor([token for token, _ in pairs], dtype=torch.int64)
    return ids, torch.tensor([bias for _, bias in pairs], dtype=torch.float32)


def penalize_(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
    """vLLM's repetition, frequency and presence penalties, in place on contiguous float32
    logits [rows, vocab].

    Only the tokens a row has seen (its prompt or output) change, so the penalties are applied
    at those (row, token) positions alone: one sorted set of flat indices for the whole batch,
    the output counts found in it, instead of dense [rows, vocab] counts and masks. A penalty
    near 0 stays in float32's range: at least its smallest normal value (one rounded to 0
    would turn a masked -inf into NaN) and a quotient at most its largest (never +inf)."""
    vocab = logits.shape[1]
    device = logits.device
    penalized = [i for i, row in enumerate(rows) if row.params.has_penalties]
    if not penalized:
        return
    outputs = _flat_positions([(i, rows[i].output_ids) for i in penalized], vocab)
    prompts = _flat_positions([(i, rows[i].prompt_ids) for i in penalized], vocab)
    output_at, counts = torch.unique(outputs, return_counts=True)  # sorted flat positions
    seen = torch.unique(torch.cat([output_at, prompts]))  # [S] sorted flat positions
    count = torch.zeros(seen.numel(), dtype=torch.float32)  # output count at each position
    count[torch.searchsorted(seen, output_at)] = counts.to(torch.float32)
    row_of = seen // vocab  # [S]
    params = [row.params for row in rows]
    rep, freq, pres = (
        torch.tensor([getattr(p, name) for p in params])[row_of].to(device)  # [S]
        for name in ("repetition_penalty", "frequency_penalty", "presence_penalty")
    )
    count = count.to(device)
    flat = logits.view(-1)
    at = seen.to(device)
    values = flat[at]  # [S]
    rep = rep.clamp(min=_FLOAT32.tiny)
    values = torch.where(values > 0, (values / rep).clamp(max=_FLOAT32.max), values * rep)
    flat[at] = values - freq * count - pres * (count > 0)


def _flat_positions(rows: list[tuple[int, Sequence[int]]], vocab: int) -> torch.Tensor:
    """int64 [N]: row * vocab + token for every token of every (row, tokens) pair, on the host
    (ValueError for a token outside the vocabulary: it would land on another row)."""
    ids = [torch.as_tensor(tokens, dtype=torch.int64) for _, tokens in rows]
    offsets = [torch.full((len(tokens),), i * vocab, dtype=torch.int64) for i, tokens in rows]
    if not ids:
        return torch.empty(0, dtype=torch.int64)
    flat_ids = torch.cat(ids)
    if flat_ids.numel() and bool(((flat_ids < 0) | (flat_ids >= vocab)).any()):
        raise ValueError(f"a token id outside the vocabulary of {vocab}")
    return flat_ids + torch.cat(offsets)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens whose probability is below min_p times the row's top probability."""
    probs = logits.softmax(dim=-1)  # [rows, vocab]
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)  # [rows, 1]
    return logits.masked_fill(probs < threshold, float("-inf"))


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> torch.Tensor:
    """Keep each row's top_k logits (0 = all) and its smallest set with cumulative probability
    >= top_p (the most likely token always stays), on whole sorted rows (the torch path: CUDA,
    float16; CPU rows go through `cpu_fused.top_cut`). The cut is the smallest value the sorted
    row keeps, so ties at it are kept whatever order the sort gave them."""
    vocab = logits.shape[1]
    sorted_logits = logits.sort(dim=-1, descending=False).values  # [rows, vocab] ascending
    if top_k is not None:
        k = torch.where(top_k > 0, top_k.clamp(max=vocab), torch.full_like(top_k, vocab))
        cut = sorted_logits.gather(1, (vocab - k).unsqueeze(1))  # [rows, 1] k-th largest
        sorted_logits = sorted_logits.masked_fill(sorted_logits < cut, float("-inf"))
    if top_p is not None:
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)  # [rows, vocab]
        drop = cumulative <= (1.0 - top_p).unsqueeze(1)
        drop[:, -1] = False
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    kept = sorted_logits.masked_fill(sorted_logits == float("-inf"), float("inf"))
    floor = kept.min(dim=-1, keepdim=True).values  # [rows, 1] smallest kept value
    return logits.masked_fill(logits < floor, float("-inf"))


def raw_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, k: int) -> Logprobs:
    """logits [rows, vocab] as the model gave them, token_ids [rows] -> log_softmax at each
    row's token, its rank (1 + the number of logits above it) and the k most likely tokens
    (descending by logit, the smaller id first on ties; k capped at the vocabulary; a row
    whose log_softmax is NaN: ids 0 .. k-1). The CPU kernel where it applies, else torch: a
    float32 log_softmax and a stable sort of the logits (the same ids and ranks; the same
    values up to the sum's rounding)."""
    k = min(k, logits.shape[-1])
    if fused_supported(logits):
        return logprob_rows(logits, token_ids, k)
    logprobs = logits.log_softmax(dim=-1, dtype=torch.float32)  # [rows, vocab]
    picked = token_ids.unsqueeze(1)  # [rows, 1]
    ranks = (logits > logits.gather(1, picked)).sum(dim=-1) + 1  # [rows]
    order = logits.sort(dim=-1, descending=True, stable=True).indices  # ties: smaller id first
    undefined = logprobs[:, :1].isnan()  # [rows, 1]: NaN or +inf logits, or all -inf
    first_ids = torch.arange(k, device=logits.device).expand(logits.shape[0], k)
    top_ids = torch.where(undefined, first_ids, order[:, :k])  # [rows, k]
    top_values = logprobs.gather(1, top_ids)  # [rows, k]
    return Logprobs(logprobs.gather(1, picked).squeeze(1), ranks, top_ids, top_values)


def _logprobs_per_row(
    raw: Logprobs, token_ids: torch.Tensor, batch: SamplingBatch, asked: list[int]
) -> list[TokenLogprobs | None]:
    """Per row of the batch: for the rows in `asked` (raw's rows, in order) the sampled token's
    raw logprob and rank and the row's top-n; None elsewhere."""
    tokens, token_logprob, ranks = (
        token_ids.tolist(),
        raw.token_logprob.tolist(),
        raw.token_rank.tolist(),
    )
    top_ids, top_values = raw.top_ids.tolist(), raw.top_logprobs.tolist()
    out: list[TokenLogprobs | None] = [None] * len(batch)
    for j, i in enumerate(asked):
        n = batch.rows[i].params.logprobs
        assert n is not None
        out[i] = TokenLogprobs(
            sampled_token_id=tokens[i],
            sampled_logprob=token_logprob[j],
            sampled_rank=ranks[j],
            top_token_ids=tuple(top_ids[j][:n]),
            top_logprobs=tuple(top_values[j][:n]),
        )
    return out
