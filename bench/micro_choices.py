"""Side-by-side measurements behind six implementation choices stated in the docs.

1. ScheduledChunk is a NamedTuple: construction cost vs an equivalent frozen dataclass.
2. Host block scatter uses numpy row copies: vs torch `index_copy_` and a plain memcpy.
3. A first prefill chunk (no cached context) attends with causal sdpa on its own K/V: vs
   `kvmesh_kernels.paged_attention` over the same K/V written to the paged cache.
4. bfloat16/float16 linear layers on CPU run on oneDNN-prepacked weights
   (`kvmesh.engine.cpu_linear.PackedLinear`): vs `F.linear` on the plain weight, and float32
   stays on `F.linear` (MKL): vs oneDNN's packed float32 path. Shapes are the bench model's
   (hidden 512, MLP 1376, vocab 32000) at decode and prefill row counts, plus SmolLM2-135M's
   merged native GEMMs at 64 rows. In float32 the winner depends on the machine, so the native
   executor measures it at load (`float32_packing`).
5. Greedy sampling (`kvmesh.engine.sampler.greedy_ids`) picks with the fused kernel
   `kvmesh_kernels.cpu_fused.argmax_rows` on the logits as the LM head gives them (float32, or
   bfloat16 without widening): vs `max(dim=-1).indices` (its fallback; `argmax(dim=-1)` beside
   it) and, for bfloat16, the float32 widening the sampler used to do first, at 32000 (bench
   model) and 49152 (SmolLM2-135M) vocabularies and 1-256 rows; the indices are checked equal.
6. The native executor's SiLU-and-mul on CPU is one fused kernel pass
   (`kvmesh.engine.native.layers.silu_and_mul`, `kvmesh_kernels.cpu_fused.silu_mul`): vs
   torch's `F.silu(gate) * up`, at the bench model's MLP width (1376) and SmolLM2-135M's (1536),
   1 to 2048 rows, float32 and bfloat16; the outputs are compared first.

Run: `.venv/bin/python bench/micro_choices.py [--linear-only | --silu-only | --fresh-only |
--greedy-only]
[--threads N]`
(torch's threads, default 2; one line per comparison, with ratios).
"""

from __future__ import annotations

import dataclasses
import sys
import time
import timeit
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F


class ChunkTuple(NamedTuple):
    seq_id: str
    token_ids: tuple[int, ...]
    start_pos: int
    block_table: tuple[int, ...]
    slot_mapping: tuple[int, ...]
    sample_seq_ids: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class ChunkDataclass:
    seq_id: str
    token_ids: tuple[int, ...]
    start_pos: int
    block_table: tuple[int, ...]
    slot_mapping: tuple[int, ...]
    sample_seq_ids: tuple[str, ...]


def best_seconds(fn: Callable[[], object], repeat: int = 5) -> float:
    """Best wall time of `repeat` calls (after one warm-up)."""
    fn()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def chunk_construction() -> None:
    args = ("s", (1,), 7, (1, 2, 3), (40,), ("s",))
    n = 200_000
    nt = min(timeit.repeat(lambda: ChunkTuple(*args), number=n, repeat=5)) / n
    dc = min(timeit.repeat(lambda: ChunkDataclass(*args), number=n, repeat=5)) / n
    print(
        f"chunk construction: NamedTuple {nt * 1e9:.0f} ns, frozen dataclass "
        f"{dc * 1e9:.0f} ns -> dataclass / NamedTuple {dc / nt:.2f}x"
    )


def host_scatter(num_blocks: int = 1024, block_bytes: int = 256 * 1024) -> None:
    cache = torch.zeros(num_blocks, block_bytes, dtype=torch.uint8)
    src = torch.randint(0, 255, (num_blocks // 2, block_bytes), dtype=torch.uint8)
    ids = torch.randperm(num_blocks)[: num_blocks // 2]
    rows, raw, idx = cache.numpy(), src.numpy(), ids.numpy()
    flat = torch.empty_like(src)
    copy = best_seconds(lambda: flat.copy_(src))
    torch_s = best_seconds(lambda: cache.index_copy_(0, ids, src))

    def numpy_rows() -> None:
        rows[idx] = raw

    numpy_s = best_seconds(numpy_rows)
    mib = src.numel() / 2**20
    print(
        f"host scatter of {mib:.0f} MiB: memcpy {copy * 1e3:.1f} ms, numpy rows "
        f"{numpy_s * 1e3:.1f} ms ({copy / numpy_s:.2f}x memcpy speed), torch index_copy_ "
        f"{torch_s * 1e3:.1f} ms ({copy / torch_s:.2f}x memcpy speed)"
    )


def fresh_chunk(dtype: torch.dtype, num_tokens: int, heads: tuple[int, int] = (8, 2)) -> None:
    from kvmesh_kernels import KVCacheSpec, allocate_kv_cache, paged_attention, write_kv

    (hq, hkv), d, bs = heads, 64, 16
    nb = -(-num_tokens // bs)
    cache = allocate_kv_cache(KVCacheSpec(nb + 4, 1, bs, hkv, d, dtype))
    layer = cache.layer(0)
    q = torch.randn(num_tokens, hq, d, dtype=dtype)  # [T, Hq, D]
    k = torch.randn(num_tokens, hkv, d, dtype=dtype)  # [T, Hkv, D]
    v = torch.randn(num_tokens, hkv, d, dtype=dtype)
    table = torch.randperm(nb + 4)[:nb].to(torch.int32)[None, :]  # [1, nb]
    slots = (table[0].long()[:, None] * bs + torch.arange(bs)).flatten()[:num_tokens]
    write_kv(layer, k, v, slots)
    seq_lens = torch.tensor([num_tokens], dtype=torch.int32)
    qsl = torch.tensor([0, num_tokens], dtype=torch.int32)
    scale = d**-0.5

    def paged() -> torch.Tensor:
        return paged_attention(q, layer, table, seq_lens, qsl, scale=scale)

    def fresh() -> torch.Tensor:
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None],
            k.transpose(0, 1)[None],
            v.transpose(0, 1)[None],
            is_causal=True,
            scale=scale,
            enable_gqa=True,
        )  # [1, Hq, T, D]
        return out[0].transpose(0, 1)

    tol = 1e-4 if dtype == torch.float32 else 3e-2
    assert torch.allclose(paged().float(), fresh().float(), atol=tol, rtol=tol)
    p, f = best_seconds(paged), best_seconds(fresh)
    print(
        f"first chunk {num_tokens} tokens, {hq}/{hkv} heads, "
        f"{str(dtype).removeprefix('torch.')}: paged {p * 1e3:.2f} ms, "
        f"fresh sdpa {f * 1e3:.2f} ms -> paged / fresh {p / f:.2f}x"
    )


LINEAR_SHAPES = ((1, 512, 1376), (16, 512, 512), (64, 512, 1376), (64, 1376, 512))
LINEAR_SHAPES += ((64, 512, 32000), (2048, 512, 1376))
# SmolLM2-135M's merged native GEMMs at a decode batch of 64: qkv, gate_up, down
LINEAR_SHAPES += ((64, 576, 960), (64, 576, 3072), (64, 1536, 576))


def linear_pair(rows: int, k: int, n: int, dtype: torch.dtype) -> tuple[float, float]:
    """Seconds per call: F.linear on the plain weight, then oneDNN on the packed weight."""
    weight = torch.randn(n, k, dtype=dtype)  # [out, in]
    x = torch.randn(rows, k, dtype=dtype)  # [rows, in]
    packed = torch.ops.mkldnn._reorder_linear_weight(weight, None)

    def plain_calls() -> None:
        for _ in range(20):
            F.linear(x, weight)

    def packed_calls() -> None:
        for _ in range(20):
            torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")

    return best_seconds(plain_calls, 7) / 20, best_seconds(packed_calls, 7) / 20


def packed_linear(dtype: torch.dtype) -> None:
    if not torch.backends.mkldnn.is_available():
        print("packed linear: oneDNN unavailable")
        return
    for rows, k, n in LINEAR_SHAPES:
        p, q = linear_pair(rows, k, n, dtype)
        print(
            f"linear {rows}x{k}x{n} {str(dtype).removeprefix('torch.')}: F.linear "
            f"{p * 1e6:.0f} us, oneDNN packed {q * 1e6:.0f} us -> plain / packed {p / q:.2f}x"
        )


def greedy_pick(rows: int, vocab: int, dtype: torch.dtype) -> None:
    """Choice 5: seconds per pick, best of 7 rounds of 20 calls each."""
    from kvmesh_kernels.cpu_fused import argmax_rows, fused_supported

    logits = torch.randn(rows, vocab).to(dtype)  # [rows, vocab]
    expected = logits.float().argmax(dim=-1)
    assert torch.equal(logits.max(dim=-1).indices, expected)
    picks: dict[str, Callable[[], object]] = {
        "argmax": lambda: logits.argmax(dim=-1),
        "max(dim).indices": lambda: logits.max(dim=-1).indices,
    }
    if dtype != torch.float32:
        picks["widen+max"] = lambda: logits.float().max(dim=-1).indices
    if fused_supported(logits):
        assert torch.equal(argmax_rows(logits), expected)
        picks["kernel"] = lambda: argmax_rows(logits)

    def twenty(pick: Callable[[], object]) -> Callable[[], None]:
        return lambda: [pick() for _ in range(20)] and None

    us = {name: best_seconds(twenty(pick), 7) / 20 * 1e6 for name, pick in picks.items()}
    times = ", ".join(f"{name} {t:.0f} us" for name, t in us.items())
    ratios = ", ".join(
        f"{name} / kernel {t / us['kernel']:.2f}x"
        for name, t in us.items()
        if "kernel" in us and name != "kernel"
    )
    print(f"greedy pick [{rows}, {vocab}] {str(dtype).removeprefix('torch.')}: {times} -> {ratios}")


def greedy_picks() -> None:
    for dtype in (torch.float32, torch.bfloat16):
        for vocab in (32000, 49152):
            for rows in (1, 16, 64, 256):
                greedy_pick(rows, vocab, dtype)


SILU_WIDTHS = (1376, 1536)  # intermediate size: the bench model, SmolLM2-135M
SILU_ROWS = (1, 24, 101, 512, 2048)


def torch_silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2I] -> [T, I]: the two torch ops the fused kernel replaces."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def silu_pair(rows: int, width: int, dtype: torch.dtype) -> tuple[float, float]:
    """Seconds per call on gate_up [rows, 2 * width]: torch's two ops, then the engine's entry
    point (the fused kernel from FUSED_SILU_MIN_OUTPUTS outputs, torch's ops below: 1 row);
    best of 7 rounds, the two interleaved."""
    from kvmesh.engine.native.layers import silu_and_mul

    gate_up = torch.randn(rows, 2 * width).to(dtype)  # [rows, 2I]
    expected, got = torch_silu_and_mul(gate_up), silu_and_mul(gate_up)
    assert torch.allclose(expected.float(), got.float(), rtol=1e-6, atol=1e-30)
    calls = max(2, min(200, 200_000 // (rows * width) + 1))

    def timed(fn: Callable[[torch.Tensor], torch.Tensor]) -> float:
        start = time.perf_counter()
        for _ in range(calls):
            fn(gate_up)
        return (time.perf_counter() - start) / calls

    rounds = [(timed(torch_silu_and_mul), timed(silu_and_mul)) for _ in range(8)][1:]
    return min(r[0] for r in rounds), min(r[1] for r in rounds)


def fused_silu() -> None:
    from kvmesh_kernels import cpu_fused

    if not cpu_fused.fused_supported(torch.zeros(1)):
        print("fused SiLU-and-mul: fused CPU library unavailable")
        return
    for dtype in (torch.float32, torch.bfloat16):
        for width in SILU_WIDTHS:
            for rows in SILU_ROWS:
                t, f = silu_pair(rows, width, dtype)
                print(
                    f"silu*up [{rows}, {width}] {str(dtype).removeprefix('torch.')}: torch "
                    f"{t * 1e6:.1f} us, fused {f * 1e6:.1f} us -> torch / fused {t / f:.2f}x"
                )


def main() -> None:
    args = sys.argv[1:]
    threads = int(args[args.index("--threads") + 1]) if "--threads" in args else 2
    torch.set_num_threads(threads)
    if "--linear-only" in args:
        for dtype in (torch.bfloat16, torch.float32):
            packed_linear(dtype)
        return
    if "--silu-only" in args:
        fused_silu()
        return
    if "--fresh-only" in args:
        fresh_chunks()
        return
    if "--greedy-only" in args:
        greedy_picks()
        return
    greedy_picks()
    for dtype in (torch.bfloat16, torch.float32):
        packed_linear(dtype)
    chunk_construction()
    host_scatter()
    fresh_chunks()
    fused_silu()


def fresh_chunks() -> None:
    """Choice 3 at the bench model's heads (8 query / 2 kv) and SmolLM2-135M's (9 / 3)."""
    for dtype in (torch.float32, torch.bfloat16):
        for heads in ((8, 2), (9, 3)):
            for n in (128, 512, 1024, 2048, 4096):
                fresh_chunk(dtype, n, heads)


if __name__ == "__main__":
    main()
