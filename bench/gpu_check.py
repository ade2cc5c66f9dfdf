"""GPU check, timing part: copy bandwidth, paged decode attention sweep, KV write, decode
CUDA graphs against eager steps (`bench/decode_graph_check.py`).

Run by bench/gpu_check.sh (which also runs the kernel tests and the transfer benchmark) or alone:

    python bench/gpu_check.py [--dry-run] [--json PATH] [--transfer-json PATH] [--pytest-rc N]

Decode attention is memory bound, so each configuration reports the bytes it must move (K/V of
every context, their scales, query and output) divided by its time, and that as a fraction of
the measured device-to-device copy bandwidth. Paged (shuffled block table) is compared with the
same kernel on an in-order block table and with torch sdpa on contiguous K/V. `--dry-run` runs
every step on the CPU under TRITON_INTERPRET=1 with tiny shapes (a smoke test, not a
measurement).
"""

from __future__ import annotations

import sys

DRY = "--dry-run" in sys.argv
if DRY:  # must precede the first triton import
    import os

    os.environ["TRITON_INTERPRET"] = "1"

import argparse  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "kernels"))
from kvmesh_kernels.cache import KVCacheSpec, LayerKV, PagedKVCache  # noqa: E402
from kvmesh_kernels.triton_attention import triton_paged_decode_attention  # noqa: E402
from kvmesh_kernels.triton_cache_ops import triton_write_kv  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode_graph_check import decode_graph_check, summary_line  # noqa: E402

BLOCK_SIZE, HQ, HKV, HEAD_DIM = 16, 32, 4, 128
GIB = 1 << 30


def timed(fn: Callable[[], Any], device: torch.device) -> float:
    """Median seconds of one call (L2 flushed between calls on CUDA)."""
    if device.type == "cuda":
        import triton.testing

        return float(triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median")) / 1e3
    fn()
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def copy_bandwidth(device: torch.device, nbytes: int) -> float:
    """Device-to-device copy GB/s, counting read + write (2 x bytes per copy)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).random_(0, 255)
    dst = torch.empty_like(src)
    if device.type == "cuda":
        for _ in range(3):
            dst.copy_(src)
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        best = math.inf
        for _ in range(10):
            start.record()
            dst.copy_(src)
            stop.record()
            stop.synchronize()
            best = min(best, start.elapsed_time(stop) / 1e3)
    else:
        best = timed(lambda: dst.copy_(src), device)
    return 2 * nbytes / best / 1e9


def make_layer(batch: int, ctx: int, kv_dtype: str, device: torch.device) -> LayerKV:
    """One layer with batch * ctx tokens of random K/V (valid fp8 codes; scales near 1)."""
    num_blocks = batch * ctx // BLOCK_SIZE
    spec = KVCacheSpec(num_blocks, 1, BLOCK_SIZE, HKV, HEAD_DIM, torch.bfloat16, kv_dtype)
    data = torch.empty(spec.data_shape, dtype=spec.storage_dtype, device=device)
    if kv_dtype == "fp8":
        data.view(torch.uint8).random_(0, 0x70)  # finite positive e4m3 codes
    else:
        data.normal_()
    scales = None
    if spec.quantized:
        scales = torch.rand(spec.scales_shape, device=device) * 0.01 + 0.005
    return PagedKVCache(spec, data, scales).layer(0)


def kv_bytes(batch: int, ctx: int, kv_dtype: str) -> int:
    elem = 1 if kv_dtype == "fp8" else 2
    scale = 2 * 4 * HKV if kv_dtype == "fp8" else 0  # K and V float32 scale per head
    return batch * ctx * (2 * HKV * HEAD_DIM * elem + scale)


def decode_row(
    batch: int, ctx: int, kv_dtype: str, device: torch.device, copy_gbs: float
) -> dict[str, Any]:
    """Time paged vs in-order decode (and sdpa on contiguous K/V for bf16) for one shape."""
    layer = make_layer(batch, ctx, kv_dtype, device)
    nb = ctx // BLOCK_SIZE
    shuffled = torch.randperm(batch * nb, device=device).view(batch, nb).to(torch.int32)
    in_order = torch.arange(batch * nb, device=device, dtype=torch.int32).view(batch, nb)
    seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device=device)
    q = torch.randn(batch, HQ, HEAD_DIM, dtype=torch.bfloat16, device=device)
    scale = HEAD_DIM**-0.5

    def run(tables: torch.Tensor) -> torch.Tensor:
        return triton_paged_decode_attention(q, layer, tables, seq_lens, scale=scale)

    moved = kv_bytes(batch, ctx, kv_dtype) + 2 * q.numel() * q.element_size()
    row: dict[str, Any] = {"kv_dtype": kv_dtype, "batch": batch, "context": ctx}
    row["paged_s"] = timed(lambda: run(shuffled), device)
    row["contiguous_s"] = timed(lambda: run(in_order), device)
    row["paged_gbs"] = moved / row["paged_s"] / 1e9
    row["fraction_of_copy"] = row["paged_gbs"] / copy_gbs
    row["paged_over_contiguous"] = row["paged_s"] / row["contiguous_s"]
    if kv_dtype == "auto":
        # The in-order table's logical K/V as contiguous [batch, Hkv, T, D] (one copy each).
        blocks = layer.data.view(batch, nb, 2, BLOCK_SIZE, HKV, HEAD_DIM)
        k, v = (
            blocks[:, :, i].permute(0, 3, 1, 2, 4).contiguous().view(batch, HKV, ctx, HEAD_DIM)
            for i in (0, 1)
        )
        q4 = q.unsqueeze(2)  # [batch, Hq, 1, D]

        def sdpa() -> torch.Tensor:
            return F.scaled_dot_product_attention(q4, k, v, scale=scale, enable_gqa=True)

        row["sdpa_s"] = timed(sdpa, device)
        row["paged_over_sdpa"] = row["paged_s"] / row["sdpa_s"]
        ref = sdpa().squeeze(2).float()  # [batch, Hq, D]
        err = (run(in_order).float() - ref).norm() / ref.norm()
        row["rel_error_vs_sdpa"] = float(err)
        del k, v, blocks
    return row


def write_row(tokens: int, kv_dtype: str, device: torch.device) -> dict[str, Any]:
    layer = make_layer(1, -(-tokens // BLOCK_SIZE) * BLOCK_SIZE, kv_dtype, device)
    key = torch.randn(tokens, HKV, HEAD_DIM, dtype=torch.bfloat16, device=device)
    value = torch.randn_like(key)
    slots = torch.randperm(layer.data.shape[0] * BLOCK_SIZE, device=device)[:tokens]
    secs = timed(lambda: triton_write_kv(layer, key, value, slots), device)
    moved = 2 * key.numel() * 2 + kv_bytes(1, tokens, kv_dtype)  # read bf16, write cache
    return {"kv_dtype": kv_dtype, "tokens": tokens, "seconds": secs,
            "tokens_per_s": tokens / secs, "gbs": moved / secs / 1e9}  # fmt: skip


def summary(result: dict[str, Any]) -> str:
    lines = [f"device: {result['device']}  copy bandwidth: {result['copy_gbs']:.0f} GB/s"]
    lines.append(f"{'kv':>4} {'batch':>5} {'ctx':>6} {'paged us':>9} {'GB/s':>7} "
                 f"{'of copy':>7} {'p/contig':>8} {'p/sdpa':>7} {'err':>8}")  # fmt: skip
    for r in result["decode"]:
        if "skipped" in r:
            lines.append(f"{r['kv_dtype']:>4} {r['batch']:>5} {r['context']:>6}  {r['skipped']}")
            continue
        lines.append(
            f"{r['kv_dtype']:>4} {r['batch']:>5} {r['context']:>6} {r['paged_s'] * 1e6:>9.1f} "
            f"{r['paged_gbs']:>7.0f} {r['fraction_of_copy']:>7.2f} "
            f"{r['paged_over_contiguous']:>8.3f} {r.get('paged_over_sdpa', math.nan):>7.3f} "
            f"{r.get('rel_error_vs_sdpa', math.nan):>8.1e}"
        )
    for w in result["write_kv"]:
        lines.append(f"write_kv {w['kv_dtype']:>4} {w['tokens']:>6} tokens: "
                     f"{w['tokens_per_s'] / 1e6:.1f} M tok/s, {w['gbs']:.0f} GB/s")  # fmt: skip
    if "decode_graphs" in result:
        lines.append(summary_line(result["decode_graphs"]))
    lines.append(f"pytest rc: {result.get('pytest_rc')}  transfer: "
                 f"{'recorded' if result.get('transfer') else 'not run'}")  # fmt: skip
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="CPU interpreter, tiny shapes")
    parser.add_argument("--json", type=Path, help="write the result here")
    parser.add_argument("--transfer-json", type=Path, help="transfer benchmark output to include")
    parser.add_argument("--pytest-rc", type=int, help="exit status of the kernel tests")
    parser.add_argument("--budget-s", type=float, default=240.0, help="stop the sweep after this")
    args = parser.parse_args()
    if not DRY and not torch.cuda.is_available():
        print("no CUDA device; use --dry-run for a CPU smoke test", file=sys.stderr)
        return 2
    device = torch.device("cpu" if DRY else "cuda")
    batches, contexts = ([1, 2], [32, 64]) if DRY else ([1, 16, 64, 256], [512, 2048, 8192, 32768])
    began = time.monotonic()
    result: dict[str, Any] = {
        "device": "cpu (dry run)" if DRY else torch.cuda.get_device_name(device),
        "torch": torch.__version__, "dry_run": DRY, "pytest_rc": args.pytest_rc,
        "shape": {"q_heads": HQ, "kv_heads": HKV, "head_dim": HEAD_DIM, "block_size": BLOCK_SIZE},
    }  # fmt: skip
    result["copy_gbs"] = copy_bandwidth(device, (1 << 20) if DRY else 4 * GIB)
    free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else 4 * GIB
    result["decode"] = []
    for kv_dtype in ("auto", "fp8"):
        for batch in batches:
            for ctx in contexts:
                base = {"kv_dtype": kv_dtype, "batch": batch, "context": ctx}
                if 2.5 * kv_bytes(batch, ctx, kv_dtype) > free:
                    result["decode"].append({**base, "skipped": "exceeds memory"})
                elif time.monotonic() - began > args.budget_s:
                    result["decode"].append({**base, "skipped": "time budget spent"})
                else:
                    result["decode"].append(
                        decode_row(batch, ctx, kv_dtype, device, result["copy_gbs"])
                    )
                    if device.type == "cuda":
                        torch.cuda.empty_cache()
    tokens = [16, 64] if DRY else [1, 256, 8192]
    result["write_kv"] = [write_row(n, kv, device) for kv in ("auto", "fp8") for n in tokens]
    try:
        result["decode_graphs"] = decode_graph_check(device, DRY)
    except Exception as error:  # reported, and the exit status says so
        result["decode_graphs"] = {"error": f"{type(error).__name__}: {error}"}
    if args.transfer_json and args.transfer_json.exists():
        text = args.transfer_json.read_text().strip()
        try:
            result["transfer"] = json.loads(text)
        except json.JSONDecodeError:
            result["transfer"] = text
    result["seconds"] = time.monotonic() - began
    print(summary(result))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2))
    return 1 if "error" in result["decode_graphs"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
