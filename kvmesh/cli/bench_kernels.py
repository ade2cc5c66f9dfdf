"""`kvmesh bench kernels`: CPU paged decode attention vs contiguous SDPA, and KV write rate.

Decode: batch B, each context T tokens, paged in random physical block order, three ways on the
same data in the same run: `scaled_dot_product_attention` on the K/V stored contiguously
`[B, Hkv, T, D]` (GQA folded into the query axis, its fastest form here), the torch reference
(`paged_decode_attention` with backend "reference": gather the blocks, then sdpa) and the fused
C++ kernel (backend "torch" on CPU: blocks read in place). Timings are medians of interleaved
repeats; each ratio is taken within one repeat (paged and contiguous run back to back) and
reported as the median with its min-max range: compare the ratios, not the absolute times.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from typing import Any


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser("kernels", help="paged vs contiguous decode attention (CPU)")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--contexts", type=int, nargs="+", default=[512, 1024, 2048, 4096])
    parser.add_argument("--q-heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--dtype", default="float32", choices=tuple(DTYPE_TOLERANCE), help="query and K/V dtype"
    )
    parser.add_argument("--write-tokens", type=int, default=4096)
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.set_defaults(func=run)


# Agreement required between the paged kernels and contiguous sdpa, per dtype (max abs error).
DTYPE_TOLERANCE = {"float32": 1e-4, "bfloat16": 3e-2, "float16": 5e-3}


def _timings_ms(fns: dict[str, Callable[[], Any]], repeats: int) -> dict[str, list[float]]:
    """Interleave the functions (one warm-up each), return each one's times in ms per repeat."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for fn in fns.values():
        fn()
    for _ in range(max(1, repeats)):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append((time.perf_counter() - start) * 1e3)
    return times


def _median_ms(fns: dict[str, Callable[[], Any]], repeats: int) -> dict[str, float]:
    return {name: statistics.median(t) for name, t in _timings_ms(fns, repeats).items()}


def _ratios(num: list[float], den: list[float]) -> tuple[float, float, float]:
    """(median, min, max) of the per-repeat ratios num / den."""
    ratios = [a / b for a, b in zip(num, den, strict=True)]
    return statistics.median(ratios), min(ratios), max(ratios)


def bench_decode(args: argparse.Namespace, context: int) -> dict[str, Any]:
    import torch
    import torch.nn.functional as F
    from kvmesh_kernels import KVCacheSpec, allocate_kv_cache, paged_decode_attention, set_backend
    from kvmesh_kernels.cpu_build import available

    b, hq, hkv, d, bs = args.batch, args.q_heads, args.kv_heads, args.head_dim, args.block_size
    dtype = getattr(torch, args.dtype)
    nb = -(-context // bs)
    cache = allocate_kv_cache(KVCacheSpec(b * nb, 1, bs, hkv, d, dtype=dtype))
    cache.data.normal_()
    layer = cache.layer(0)
    tables = torch.randperm(b * nb).view(b, nb).to(torch.int32)  # [B, nb]
    seq_lens = torch.full((b,), context, dtype=torch.int32)  # [B]
    ids = tables.reshape(-1).long()
    # The same K/V, contiguous: [B, Hkv, T, D]
    k = layer.data[:, 0].index_select(0, ids).view(b, nb * bs, hkv, d)[:, :context]
    v = layer.data[:, 1].index_select(0, ids).view(b, nb * bs, hkv, d)[:, :context]
    k, v = k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous()
    query = torch.randn(b, hq, d, dtype=dtype)  # [B, Hq, D]
    q4 = query.view(b, hkv, hq // hkv, d)  # [B, Hkv, G, D]
    scale = d**-0.5

    def paged(backend: str) -> Any:
        set_backend(backend)
        try:
            return paged_decode_attention(query, layer, tables, seq_lens, scale=scale)
        finally:
            set_backend(None)

    fns: dict[str, Callable[[], Any]] = {
        "contiguous": lambda: F.scaled_dot_product_attention(q4, k, v, scale=scale),
        "reference": lambda: paged("reference"),
    }
    fused_ok = available()
    if fused_ok:
        fns["fused"] = lambda: paged("torch")
    times = _timings_ms(fns, args.repeats)
    ms = {name: statistics.median(t) for name, t in times.items()}
    dense = F.scaled_dot_product_attention(q4, k, v, scale=scale).reshape(b, hq, d)
    for name in fns:
        if name != "contiguous":
            out = fns[name]()
            error = (out.float() - dense.float()).abs().max().item()
            assert error <= DTYPE_TOLERANCE[args.dtype], f"{name} and contiguous disagree: {error}"
    ref_ratio = _ratios(times["reference"], times["contiguous"])
    fused_ratio = _ratios(times["fused"], times["contiguous"]) if fused_ok else None
    row = {
        "context": context,
        "contiguous_ms": ms["contiguous"],
        "reference_ms": ms["reference"],
        "reference_ratio": ref_ratio[0],
        "reference_ratio_range": list(ref_ratio[1:]),
        "fused_ms": ms.get("fused"),
        "fused_ratio": fused_ratio[0] if fused_ratio else None,
        "fused_ratio_range": list(fused_ratio[1:]) if fused_ratio else None,
    }
    return row


def bench_write(args: argparse.Namespace, kv_dtype: str) -> dict[str, Any]:
    import torch
    from kvmesh_kernels import KVCacheSpec, allocate_kv_cache, write_kv

    n, bs = args.write_tokens, args.block_size
    dtype = getattr(torch, args.dtype)
    spec = KVCacheSpec(-(-n // bs) * 2, 1, bs, args.kv_heads, args.head_dim, dtype, kv_dtype)
    cache = allocate_kv_cache(spec)
    key = torch.randn(n, args.kv_heads, args.head_dim, dtype=dtype)  # [n, Hkv, D]
    value = torch.randn(n, args.kv_heads, args.head_dim, dtype=dtype)
    slots = torch.randperm(cache.spec.num_blocks * bs)[:n]  # [n]
    ms = _median_ms({"w": lambda: write_kv(cache.layer(0), key, value, slots)}, args.repeats)
    return {"kv_dtype": kv_dtype, "tokens": n, "ms": ms["w"], "tokens_per_s": n / ms["w"] * 1e3}


def run(args: argparse.Namespace) -> int:
    import torch
    from kvmesh_kernels.cpu_build import available, machine

    decode = [bench_decode(args, c) for c in args.contexts]
    write = [bench_write(args, kv) for kv in ("auto", "int8", "fp8")]
    shape = {
        "batch": args.batch,
        "q_heads": args.q_heads,
        "kv_heads": args.kv_heads,
        "head_dim": args.head_dim,
        "block_size": args.block_size,
        "dtype": args.dtype,
        "threads": torch.get_num_threads(),
        "fused_kernel": available(),
    }
    result = {"shape": shape, "machine": machine(), "decode": decode, "write_kv": write}
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    _print_tables(result)
    return 0


def _print_tables(result: dict[str, Any]) -> None:
    from kvmesh_kernels.cpu_build import isa_text
    from rich.console import Console
    from rich.table import Table

    shape = ", ".join(f"{k}={v}" for k, v in result["shape"].items())
    host = result["machine"]
    title = f"paged decode vs contiguous SDPA ({shape}; {host['cpu']}, {isa_text(host)})"
    table = Table(title=title)
    cols = ("context", "contiguous ms", "reference ms", "fused ms", "reference / contig")
    for col in (*cols, "fused / contig", "fused / contig range"):
        table.add_column(col, justify="right")

    def fmt(value: float | None, digits: int) -> str:
        return "n/a" if value is None else f"{value:.{digits}f}"

    def fmt_range(value: list[float] | None) -> str:
        return "n/a" if value is None else f"{value[0]:.2f}-{value[1]:.2f}"

    for row in result["decode"]:
        table.add_row(
            str(row["context"]),
            fmt(row["contiguous_ms"], 1),
            fmt(row["reference_ms"], 1),
            fmt(row["fused_ms"], 1),
            fmt(row["reference_ratio"], 2),
            fmt(row["fused_ratio"], 2),
            fmt_range(row["fused_ratio_range"]),
        )
    writes = Table(title="write_kv (random slots)")
    for col in ("kv dtype", "tokens", "ms", "tokens/s"):
        writes.add_column(col, justify="right")
    for row in result["write_kv"]:
        writes.add_row(
            row["kv_dtype"], str(row["tokens"]), f"{row['ms']:.2f}", f"{row['tokens_per_s']:,.0f}"
        )
    console = Console()
    console.print(table)
    console.print(writes)
