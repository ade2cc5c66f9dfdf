"""Fused CPU paged attention side by side: float32 / bfloat16 / float16 / int8 / fp8 caches.

Run: `python -m kvmesh_kernels.cpu_bench [--repeats 9] [--threads N] [--isas auto avx2]
[--baseline-source OLD.cpp [--baseline-same-call]] [--huge-pages] [--read-floor] [--json]`
(one thread is steadier on a shared machine). `--huge-pages` runs every variant on the cache
in 4 KiB pages (`-4k`) and on the same contents in transparent huge pages (`-thp`,
`kvmesh_kernels.hugepages`).

Cases (blocks in random physical order; a call is one model step: every layer in turn, as the
engine runs them, over a block-major cache of that many layers):
  w1-decode    the W1 serving shape: 8 layers, batch 64, contexts uniform in [300, 700]
               (seeded), one query token each, 8 query heads, 2 kv heads, head dim 64, block
               size 16 (131 MB of bfloat16 K/V per step)
  w1-decode-g3 w1-decode with SmolLM2's 9 query / 3 kv heads
  l3-decode-g3 1 layer, batch 48, context 160, SmolLM2's heads: 5.9 MB of bfloat16 K/V (11.8
               MB float32) that stay in L3 between calls, so the step's arithmetic shows with
               the memory mostly out of the way
  big-decode   1 layer, batch 32, context 2048, 32 query heads, 8 kv heads, head dim 128
  w1-extend    8 layers, 4 chunks of 128 tokens after 384 cached (q_len 128, context 512)
  w1-prompt-g3 8 layers, 8 whole prompts of 272 tokens (W1's mean), SmolLM2's 9 / 3 heads
  prompt2048-g3  4 layers, one whole prompt of 2048 tokens, SmolLM2's heads
Caches "int8" and "fp8" are bfloat16 models' K/V quantized (`kvmesh_kernels.quant`), read by
bfloat16 queries. Variants, all in this process with interleaved repeats: the kernel through
`FusedCall` as the engine calls it (query read and output written in the model dtype), once
per `--isas` entry ("auto" = the best path this CPU runs; "avx2", "baseline" cap it), and with
`--baseline-source` the same call into a library built from another version of
`csrc/cpu_paged_attention.cpp` (e.g. `git show REV:kernels/kvmesh_kernels/csrc/...`; headers
next to that file are found first). That baseline is driven as the first versions' Python
did (the query converted to a float32 contiguous copy, a float32 output converted back), or
with `--baseline-same-call` exactly as this version calls its own build, capped at the first
`--isas` entry (for a baseline that takes this version's call parameters). Each ratio is taken
within one repeat against the first variant (the baseline when given) and reported as the
median with its min-max range; GB/s counts the K/V bytes the call reads. Outputs are checked
against the first variant. `--read-floor` adds `kv-read`: the same layers' K/V rows read
through the same tables and nothing else (`kvmesh_kernels.cpu_kv_read`), the floor of a
decode step on this machine's paged reads; its ratio is its time over the first variant's.
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import hashlib
import json
import random
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvmesh_kernels import cpu_attention, cpu_build, cpu_kv_read
from kvmesh_kernels.cache import KVCacheSpec, LayerKV, allocate_kv_cache
from kvmesh_kernels.hugepages import thp_mode
from kvmesh_kernels.quant import quantize

# cache name -> (model dtype: queries and K/V before storage, storage format)
DTYPES = {
    "float32": (torch.float32, "auto"),
    "bfloat16": (torch.bfloat16, "auto"),
    "float16": (torch.float16, "auto"),
    "int8": (torch.bfloat16, "int8"),
    "fp8": (torch.bfloat16, "fp8"),
}


@dataclass(frozen=True)
class Case:
    """A batch shape: per sequence (context length, query length)."""

    name: str
    lens: tuple[int, ...]
    q_lens: tuple[int, ...]
    q_heads: int
    kv_heads: int
    head_dim: int
    layers: int = 1
    block_size: int = 16


def cases() -> list[Case]:
    rng = random.Random(0)
    w1 = tuple(rng.randint(300, 700) for _ in range(64))
    return [
        Case("w1-decode", w1, (1,) * 64, 8, 2, 64, layers=8),
        Case("w1-decode-g3", w1, (1,) * 64, 9, 3, 64, layers=8),  # SmolLM2's heads
        Case("l3-decode-g3", (160,) * 48, (1,) * 48, 9, 3, 64),  # K/V stays in L3
        Case("big-decode", (2048,) * 32, (1,) * 32, 32, 8, 128),
        Case("w1-extend", (512,) * 4, (128,) * 4, 8, 2, 64, layers=8),
        Case("w1-prompt-g3", (272,) * 8, (272,) * 8, 9, 3, 64, layers=8),
        Case("prompt2048-g3", (2048,), (2048,), 9, 3, 64, layers=4),
    ]


@dataclass
class Batch:
    """One case's tensors in one dtype."""

    layers: list[LayerKV]
    tables: torch.Tensor  # [batch, max_blocks] int32
    lens: torch.Tensor  # [batch] int32
    starts: torch.Tensor  # [batch + 1] int32
    query: torch.Tensor  # [num_tokens, Hq, D]
    kv_bytes: int


def make_batch(case: Case, cache_name: str, huge_pages: bool = True) -> Batch:
    dtype, kv_dtype = DTYPES[cache_name]
    gen = torch.Generator().manual_seed(1)
    bs = case.block_size
    need = [-(-n // bs) for n in case.lens]
    spec = KVCacheSpec(sum(need), case.layers, bs, case.kv_heads, case.head_dim, dtype, kv_dtype)
    cache = allocate_kv_cache(spec, huge_pages=huge_pages)
    kv = torch.randn(spec.data_shape, generator=gen).to(dtype)
    if cache.scales is None:
        cache.data.copy_(kv)
    else:
        values, scales = quantize(kv, kv_dtype)
        cache.data.copy_(values)
        cache.scales.copy_(scales)
    del kv
    perm = torch.randperm(spec.num_blocks, generator=gen)
    tables = torch.zeros(len(case.lens), max(need), dtype=torch.int32)
    first = 0
    for b, n in enumerate(need):
        tables[b, :n] = perm[first : first + n].to(torch.int32)
        first += n
    starts = torch.tensor([0, *torch.tensor(case.q_lens).cumsum(0).tolist()], dtype=torch.int32)
    query = torch.randn(sum(case.q_lens), case.q_heads, case.head_dim, generator=gen).to(dtype)
    row_bytes = case.head_dim * cache.data.element_size() + (4 if spec.quantized else 0)
    kv_bytes = 2 * sum(case.lens) * case.kv_heads * row_bytes * case.layers  # with scales
    lens = torch.tensor(case.lens, dtype=torch.int32)
    layers = [cache.layer(i) for i in range(case.layers)]
    return Batch(layers, tables, lens, starts, query, kv_bytes)


def load_baseline(source: Path) -> ctypes.CDLL:
    """Build (or reuse) a library from another version of the attention source."""
    from torch.utils import cpp_extension

    key = hashlib.sha256(source.read_bytes()).hexdigest()[:16]
    build_dir = cpu_build.cache_root() / f"bench-baseline-{key}"
    build_dir.mkdir(parents=True, exist_ok=True)
    path = cpp_extension.load(
        name=f"kvmesh_cpu_attn_baseline_{key}",
        sources=[str(source)],
        extra_cflags=[*cpu_build.CFLAGS, f"-I{cpu_build.SOURCE.parent}"],  # shared headers
        extra_ldflags=list(cpu_build.LDFLAGS),
        build_directory=str(build_dir),
        is_python_module=False,
        verbose=False,
    )
    lib = ctypes.CDLL(str(path))
    getattr(lib, cpu_build.ENTRY).argtypes = [ctypes.c_void_p]
    getattr(lib, cpu_build.ENTRY).restype = ctypes.c_int
    return lib


def variants(
    batch: Batch,
    isas: list[str],
    baseline: ctypes.CDLL | None,
    suffix: str = "",
    same_call: bool = False,
) -> dict[str, Callable[[], torch.Tensor]]:
    """name -> one model step over the batch: a kernel call per layer, the outputs stacked
    (the baseline first when given, called as this version calls its build with
    `same_call`); `suffix` is appended to each name."""
    pointers = [cpu_attention.layer_pointers(layer) for layer in batch.layers]
    scale = batch.query.shape[-1] ** -0.5
    meta = (batch.layers[0], batch.tables, batch.lens, batch.starts)
    fns: dict[str, Callable[[], torch.Tensor]] = {}

    def step(call: cpu_attention.FusedCall, isa: str) -> torch.Tensor:
        return torch.stack(
            [
                call(batch.query, d, s, scale=scale, sliding_window=None, isa=isa)
                for d, s in pointers
            ]
        )

    if baseline is not None and same_call:
        same = cpu_attention.FusedCall(*meta)
        same._entry = getattr(baseline, cpu_build.ENTRY)
        fns["baseline" + suffix] = functools.partial(step, same, isas[0] if isas else "auto")
    elif baseline is not None:
        old = cpu_attention.FusedCall(*meta)
        old._entry = getattr(baseline, cpu_build.ENTRY)
        dtype = batch.query.dtype

        def run_old() -> torch.Tensor:
            outs = []
            for data_ptr, scales_ptr in pointers:
                q = batch.query.to(torch.float32).contiguous()  # what the old Python passed
                out = torch.empty_like(q)
                old(q, data_ptr, scales_ptr, scale=scale, sliding_window=None, out=out)
                outs.append(out.to(dtype))
            return torch.stack(outs)

        fns["baseline" + suffix] = run_old
    for isa in isas:
        fns[f"fused-{isa}{suffix}"] = functools.partial(step, cpu_attention.FusedCall(*meta), isa)
    return fns


def read_floor(batch: Batch) -> Callable[[], int]:
    """One step's K/V read alone: every layer's rows of the batch's contexts, in table order."""

    def run() -> int:
        result = 0
        for layer in batch.layers:
            result ^= cpu_kv_read.read_kv(layer, batch.tables, batch.lens)
        return result

    return run


def time_ms(fns: dict[str, Callable[[], Any]], repeats: int, inner: int) -> dict[str, list[float]]:
    """Interleaved repeats (one warm-up each): per variant, ms per call in each repeat."""
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            for _ in range(inner):
                fn()
            times[name].append((time.perf_counter() - start) * 1e3 / inner)
    return times


def measure(
    case: Case,
    dtype_name: str,
    isas: list[str],
    baseline: ctypes.CDLL | None,
    repeats: int,
    compare_huge_pages: bool = False,
    same_call: bool = False,
    with_read_floor: bool = False,
) -> dict[str, Any]:
    """One case in one dtype; with `compare_huge_pages` every variant runs on a cache advised
    against huge pages (`-4k`) and on the same contents in huge pages (`-thp`); `same_call`:
    see `variants`; `with_read_floor` times `kv-read` (`read_floor`) too, on the huge-page
    cache."""
    if compare_huge_pages:
        small = make_batch(case, dtype_name, huge_pages=False)
        batch = make_batch(case, dtype_name, huge_pages=True)
        fns = {
            **variants(small, isas, baseline, "-4k", same_call),
            **variants(batch, isas, baseline, "-thp", same_call),
        }
    else:
        batch = make_batch(case, dtype_name)
        fns = variants(batch, isas, baseline, same_call=same_call)
    first = next(iter(fns))
    ref = fns[first]().float()
    tol = 1e-4 if dtype_name == "float32" else 2e-2
    for name, fn in fns.items():
        err = (fn().float() - ref).abs().max().item()
        assert err <= tol, f"{case.name} {dtype_name}: {name} differs from {first} by {err}"
    timed: dict[str, Callable[[], Any]] = dict(fns)
    if with_read_floor:
        timed["kv-read"] = read_floor(batch)
    times = time_ms(timed, repeats, inner=1)
    row: dict[str, Any] = {"case": case.name, "dtype": dtype_name}
    for name, ts in times.items():
        ms = statistics.median(ts)
        ratios = [a / b for a, b in zip(ts, times[first], strict=True)]
        row[name] = {
            "ms": ms,
            "gb_per_s": batch.kv_bytes / ms / 1e6,
            f"vs_{first}": statistics.median(ratios),
            "range": [min(ratios), max(ratios)],
        }
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument(
        "--dtypes", nargs="+", default=["float32", "bfloat16", "float16"], choices=list(DTYPES)
    )
    parser.add_argument("--cases", nargs="+", default=[c.name for c in cases()])
    parser.add_argument("--isas", nargs="+", default=["auto", "avx2"])
    parser.add_argument("--baseline-source", type=Path, default=None)
    parser.add_argument(
        "--baseline-same-call",
        action="store_true",
        help="call the baseline exactly as this version calls its own build",
    )
    parser.add_argument("--threads", type=int, default=None, help="torch/OpenMP threads")
    parser.add_argument(
        "--huge-pages",
        action="store_true",
        help="each variant on a cache in 4 KiB pages (-4k) and in transparent huge pages (-thp)",
    )
    parser.add_argument(
        "--read-floor",
        action="store_true",
        help="time the same K/V read alone beside the kernel (kv-read)",
    )
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if not cpu_build.available() or (args.read_floor and not cpu_kv_read.available()):
        print("fused CPU kernel unavailable", file=sys.stderr)
        return 1
    baseline = load_baseline(args.baseline_source) if args.baseline_source else None
    rows = [
        measure(
            case,
            dtype,
            args.isas,
            baseline,
            args.repeats,
            args.huge_pages,
            args.baseline_same_call,
            args.read_floor,
        )
        for case in cases()
        if case.name in args.cases
        for dtype in args.dtypes
    ]
    pages = {"thp": thp_mode(), "huge_pages_compared": args.huge_pages}  # the default: huge
    host = cpu_build.machine()
    if args.json:
        report = {"threads": torch.get_num_threads(), "machine": host, **pages, "rows": rows}
        print(json.dumps(report, indent=2))
        return 0
    print(f"{host['cpu']} ({host['isa']})")
    print(f"threads={torch.get_num_threads()} repeats={args.repeats} THP {pages['thp']}")
    for row in rows:
        parts = []
        for name, v in row.items():
            if isinstance(v, dict):
                ratio = next(val for key, val in v.items() if key.startswith("vs_"))
                rng = v["range"]
                parts.append(
                    f"{name} {v['ms']:.2f} ms {v['gb_per_s']:.1f} GB/s "
                    f"x{ratio:.2f} ({rng[0]:.2f}-{rng[1]:.2f})"
                )
        print(f"{row['case']:<11} {row['dtype']:<9} " + " | ".join(parts))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
