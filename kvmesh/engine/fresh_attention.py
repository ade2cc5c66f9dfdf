"""Which first prefill chunks take the fresh path on CPU: a rule measured at start.

A first chunk (no cached context) can be attended two ways (`kvmesh.engine.attention`): through
the paged kernel like every other chunk, or by causal sdpa on the step's own K/V (the fresh
path). Which is faster depends on the machine as much as on the dtype: on an Intel host with
AMX, sdpa ran bfloat16 chunks 1.9-3.6x faster than the kernel, while the kernel ran float32
chunks up to 2,048 tokens 0.7-1.0x sdpa's time; on an AMD host with AVX-512 and no AMX the
kernel took 0.3-0.5x sdpa's time in both dtypes at every length from 128 to 4,096 tokens
(`bench/micro_choices.py --fresh-only`, docs/BENCHMARKS.md "Implementation choices").

So with `fresh_attention="auto"` the runner times both paths through `attend` itself, at the
model's heads and dtype, on one first chunk of each PROBE_TOKENS length (best of three calls,
once per process, shape and thread count), and sends a step's first chunks to sdpa when the
longest is past the probe length from which on sdpa is MARGIN faster at every longer probe.
"on" and "off" force either path.
"""

from __future__ import annotations

import functools
import itertools
import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from kvmesh_kernels.cache import KVCacheSpec, allocate_kv_cache

from kvmesh.engine.attention import ForwardContext, attend
from kvmesh.engine.config import FRESH_ATTENTION_MODES
from kvmesh.engine.cpu_linear import best_of

logger = logging.getLogger(__name__)

PROBE_TOKENS = (512, 2048)
MARGIN = 1.1  # sdpa must take under 1/MARGIN of the kernel's time to be chosen
PROBE_BLOCK_SIZE = 16


@dataclass(frozen=True)
class FreshRule:
    """A step's trailing first chunks take the fresh path when the longest is longer than
    `min_tokens` (0: always); never when `min_tokens` is None."""

    min_tokens: int | None

    def pays(self, bounds: Sequence[int]) -> bool:
        """bounds: token bounds of the trailing first chunks (at least two entries)."""
        if self.min_tokens is None:
            return False
        return max(hi - lo for lo, hi in itertools.pairwise(bounds)) > self.min_tokens

    def describe(self) -> str:
        if self.min_tokens is None:
            return "paged kernel for every first chunk"
        if self.min_tokens == 0:
            return "causal sdpa for every first chunk"
        return f"causal sdpa for first chunks over {self.min_tokens} tokens"


@dataclass(frozen=True)
class ProbeShape:
    """What the probe measures: the model's attention heads and the cache's element types."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    kv_dtype: str


def fresh_rule(mode: str, device: torch.device, shape: ProbeShape) -> FreshRule:
    """The rule for `mode` (FRESH_ATTENTION_MODES); the fresh path exists on CPU only."""
    if mode not in FRESH_ATTENTION_MODES:
        raise ValueError(f"fresh_attention must be one of {FRESH_ATTENTION_MODES}, got {mode!r}")
    if device.type != "cpu" or mode == "off" or shape.kv_dtype != "auto":
        return FreshRule(None)  # quantized caches attend through the kernel anyway
    if mode == "on":
        return FreshRule(0)
    return measured_rule(shape, torch.get_num_threads())


_probe_lock = threading.Lock()  # engines starting together measure one after another


def measured_rule(shape: ProbeShape, threads: int) -> FreshRule:
    """Time both paths on one first chunk per PROBE_TOKENS length, once per shape and thread
    count (`threads` is part of the key only); a probe that fails leaves the paged kernel for
    every first chunk (correct on every path, logged)."""
    with _probe_lock:
        return _measured_rule(shape, threads)


@functools.cache
def _measured_rule(shape: ProbeShape, threads: int) -> FreshRule:
    try:
        ratios = {tokens: _paged_over_fresh(shape, tokens) for tokens in PROBE_TOKENS}
    except (RuntimeError, ValueError) as exc:
        logger.warning("first prefill chunks: paged kernel (the start-time probe failed: %s)", exc)
        return FreshRule(None)
    rule = _rule_from(ratios)
    logger.info(
        "first prefill chunks: %s (paged kernel / sdpa time at %s, measured at start)",
        rule.describe(),
        ", ".join(f"{n} tokens {r:.2f}x" for n, r in ratios.items()),
    )
    return rule


def _rule_from(paged_over_fresh: dict[int, float]) -> FreshRule:
    """The shortest probe length from which on sdpa wins by MARGIN at every longer probe sets
    the threshold: all probes -> always; only longer ones -> above the previous probe length."""
    lengths = sorted(paged_over_fresh)
    winning = [n for n in lengths if paged_over_fresh[n] > MARGIN]
    if not winning or any(paged_over_fresh[n] <= MARGIN for n in lengths if n > winning[0]):
        return FreshRule(None)
    first = lengths.index(winning[0])
    return FreshRule(0 if first == 0 else lengths[first - 1])


def _paged_over_fresh(shape: ProbeShape, tokens: int) -> float:
    """The kernel's time over sdpa's on one first chunk of `tokens` tokens, through `attend`
    (K/V written to a probe cache on both paths, as in a step)."""
    generator = torch.Generator().manual_seed(0)
    blocks = -(-tokens // PROBE_BLOCK_SIZE)
    spec = KVCacheSpec(blocks, 1, PROBE_BLOCK_SIZE, shape.num_kv_heads, shape.head_dim, shape.dtype)
    cache = allocate_kv_cache(spec)
    q = torch.randn(tokens, shape.num_heads, shape.head_dim, generator=generator)  # [T, Hq, D]
    k = torch.randn(tokens, shape.num_kv_heads, shape.head_dim, generator=generator)
    v = torch.randn(tokens, shape.num_kv_heads, shape.head_dim, generator=generator)
    q, k, v = q.to(shape.dtype), k.to(shape.dtype), v.to(shape.dtype)  # [T, H, D]

    def context(fresh: bool) -> ForwardContext:
        return ForwardContext(
            kv_cache=cache,
            slot_mapping=torch.arange(tokens, dtype=torch.int64),
            block_tables=torch.arange(blocks, dtype=torch.int32)[None, :],  # [1, blocks]
            seq_lens=torch.tensor([tokens], dtype=torch.int32),
            query_start_loc=torch.tensor([0, tokens], dtype=torch.int32),
            num_paged_seqs=0 if fresh else 1,
            num_paged_tokens=0 if fresh else tokens,
            fresh_bounds=(0, tokens) if fresh else (),
        )

    paged_ctx, fresh_ctx = context(False), context(True)
    scale = shape.head_dim**-0.5
    with torch.inference_mode():
        seconds = []
        for ctx in (paged_ctx, fresh_ctx):
            step = functools.partial(attend, ctx, 0, q, k, v, scale=scale, sliding_window=None)
            step()  # warm-up: first touch of the cache and buffers
            seconds.append(best_of(step, rounds=3, calls=1))
    return seconds[0] / seconds[1]
