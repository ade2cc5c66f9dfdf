"""The attention adapter: the fresh-chunk sdpa path equals attention through the paged cache."""

from __future__ import annotations

import itertools
import logging
import re

import pytest
import torch
from kvmesh_kernels import KVCacheSpec, allocate_kv_cache

from kvmesh.engine.attention import ForwardContext, paged_attention_forward

HQ, HKV, D, BS = 8, 2, 32, 4


class _Layer(torch.nn.Module):
    layer_idx = 0


def _context(lens: list[int], starts: list[int], fresh_from: int, kv_dtype: str) -> ForwardContext:
    """Sequence b computes lens[b] tokens from position starts[b]; blocks 8b.. are its own."""
    spec = KVCacheSpec(64, 1, BS, HKV, D, torch.float32, kv_dtype)
    cache = allocate_kv_cache(spec, torch.device("cpu"))
    tables = [[8 * b + i for i in range(8)] for b in range(len(lens))]
    slots = [
        tables[b][p // BS] * BS + p % BS
        for b, (n, s) in enumerate(zip(lens, starts, strict=True))
        for p in range(s, s + n)
    ]
    bounds = [0, *itertools.accumulate(lens)]
    return ForwardContext(
        kv_cache=cache,
        slot_mapping=torch.tensor(slots),
        block_tables=torch.tensor(tables, dtype=torch.int32),
        seq_lens=torch.tensor([s + n for n, s in zip(lens, starts, strict=True)]).int(),
        query_start_loc=torch.tensor(bounds, dtype=torch.int32),
        num_paged_seqs=fresh_from,
        num_paged_tokens=bounds[fresh_from],
        fresh_bounds=tuple(bounds[fresh_from:]) if fresh_from < len(lens) else (),
    )


@pytest.mark.parametrize(("window", "kv_dtype"), [(None, "auto"), (16, "auto"), (None, "int8")])
def test_fresh_path_matches_paged_attention(window: int | None, kv_dtype: str) -> None:
    lens, starts = [1, 1, 5, 12, 7], [9, 3, 6, 0, 0]  # two decodes, one extend, two fresh
    torch.manual_seed(0)
    total = sum(lens)
    q = torch.randn(1, HQ, total, D)
    k = torch.randn(1, HKV, total, D)
    v = torch.randn(1, HKV, total, D)
    history = torch.randn(64, 2, BS, HKV, D)  # context of the decodes and the extend
    outs = []
    for fresh_from in (3, len(lens)):
        ctx = _context(lens, starts, fresh_from, kv_dtype)
        if kv_dtype == "auto":
            ctx.kv_cache.layer(0).data.copy_(history)
        out, _ = paged_attention_forward(
            _Layer(), q, k, v, None, scaling=D**-0.5, sliding_window=window, kvmesh_ctx=ctx
        )
        outs.append(out)
    assert outs[0].shape == (1, total, HQ, D)
    tol = 1e-5 if kv_dtype == "auto" else 0.1
    torch.testing.assert_close(outs[0], outs[1], atol=tol, rtol=tol)


def test_fresh_rule_thresholds_and_forced_modes() -> None:
    """A rule sends a step's first chunks to sdpa when its longest one exceeds the threshold;
    probes where sdpa wins at every length from some length on set the threshold; "on" and
    "off" force it; outside the CPU, and on quantized caches, the kernel attends."""
    from kvmesh.engine.fresh_attention import FreshRule, ProbeShape, _rule_from, fresh_rule

    assert FreshRule(0).pays((10, 11)) and not FreshRule(None).pays((0, 4096))
    assert FreshRule(512).pays((10, 20, 533)) and not FreshRule(512).pays((0, 512, 1024))
    assert _rule_from({512: 2.0, 2048: 3.5}) == FreshRule(0)
    assert _rule_from({512: 0.7, 2048: 1.3}) == FreshRule(512)
    assert _rule_from({512: 0.4, 2048: 0.5}) == FreshRule(None)
    assert _rule_from({512: 1.3, 2048: 0.9}) == FreshRule(None)  # no clean crossover
    assert _rule_from({512: 1.05, 2048: 1.05}) == FreshRule(None)  # within the margin
    shape = ProbeShape(4, 2, 16, torch.float32, "auto")
    cpu = torch.device("cpu")
    assert fresh_rule("on", cpu, shape) == FreshRule(0)
    assert fresh_rule("off", cpu, shape) == FreshRule(None)
    assert fresh_rule("on", torch.device("cuda"), shape) == FreshRule(None)
    assert fresh_rule("on", cpu, ProbeShape(4, 2, 16, torch.float32, "int8")) == FreshRule(None)
    with pytest.raises(ValueError, match="fresh_attention"):
        fresh_rule("sometimes", cpu, shape)


def test_fresh_rule_auto_measures_once_per_shape(caplog: pytest.LogCaptureFixture) -> None:
    """auto times the kernel and sdpa through `attend` at the given heads, logs the ratio at
    every probe length and derives the rule from them; a second engine of the same shape
    reuses the measurement (no second probe, no second log line)."""
    from kvmesh.engine import fresh_attention as fa

    fa._measured_rule.cache_clear()
    shape = fa.ProbeShape(6, 2, 32, torch.bfloat16, "auto")
    with caplog.at_level(logging.INFO, logger="kvmesh.engine.fresh_attention"):
        rule = fa.fresh_rule("auto", torch.device("cpu"), shape)
        again = fa.fresh_rule("auto", torch.device("cpu"), shape)
    (line,) = [r.getMessage() for r in caplog.records]
    ratios = {int(n): float(r) for n, r in re.findall(r"(\d+) tokens ([\d.]+)x", line)}
    assert sorted(ratios) == sorted(fa.PROBE_TOKENS)
    assert rule == again
    if all(abs(r - fa.MARGIN) > 0.01 for r in ratios.values()):  # the log rounds to 0.01
        assert rule == fa._rule_from(ratios)
    assert rule.describe() in line


def test_fresh_rule_probe_failure_keeps_the_kernel(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from kvmesh.engine import fresh_attention as fa

    def broken(shape: object, tokens: int) -> float:
        raise RuntimeError("no kernel library")

    fa._measured_rule.cache_clear()
    monkeypatch.setattr(fa, "_paged_over_fresh", broken)
    shape = fa.ProbeShape(6, 2, 32, torch.bfloat16, "auto")
    with caplog.at_level(logging.WARNING, logger="kvmesh.engine.fresh_attention"):
        assert fa.fresh_rule("auto", torch.device("cpu"), shape) == fa.FreshRule(None)
    assert "probe failed: no kernel library" in caplog.text
    fa._measured_rule.cache_clear()
