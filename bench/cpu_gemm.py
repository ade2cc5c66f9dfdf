"""kvmesh's CPU GEMM against oneDNN's packed GEMM (and MKL's in float32) on a decode step's
linears.

One "step" is every layer's four linears (q|k|v, o, gate|up, down) of a Llama-family model at
M rows, each layer with its own weights, so that (as in a real decode step) the weights come
from memory rather than cache: SmolLM2-135M's shapes by default (30 layers, hidden 576,
intermediate 1536, 9 / 3 heads of 64: 212 MB of bfloat16 weights, 424 MB in float32). The
GEMMs run in this process, alternating, best of `--repeats`; prints one JSON line per M with
milliseconds per step, GFLOP/s and each other GEMM's time over kvmesh's (above 1: kvmesh
faster; `kvmesh_no_prefetch` is kvmesh's kernel with its weight prefetch off, the same as
`kvmesh` below 5 rows, where the kernel no longer prefetches), the dtype and the CPU's ISA.

`--hot` runs every layer on the first layer's weights instead, which stay in cache: the
difference is what streaming the weights costs each GEMM.

`--silu` adds two steps of kvmesh's GEMM whose gate|up is followed by SiLU-and-mul:
`kvmesh_then_silu` (the GEMM, then the `cpu_fused.silu_mul` kernel on its [M, 2I] output) and
`kvmesh_silu_epilogue` (`cpu_gemm.gate_up_silu`: the activation in the GEMM's epilogue, what the
native executor runs), and their ratio `silu_epilogue_over_then_silu`.

Run: `.venv/bin/python bench/cpu_gemm.py [--dtype bfloat16|float32] [--rows 1 8 16 ...]
[--threads 2] [--hot] [--silu]`
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F
from kvmesh_kernels import cpu_fused, cpu_gemm
from kvmesh_kernels.cpu_build import machine

from kvmesh.engine.cpu_linear import PackedLinear


def layer_shapes(hidden: int, inter: int, heads: int, kv_heads: int) -> list[tuple[int, int]]:
    """(out, in) of q|k|v, o, gate|up, down."""
    head_dim = hidden // heads
    qkv = (heads + 2 * kv_heads) * head_dim
    return [(qkv, hidden), (hidden, heads * head_dim), (2 * inter, hidden), (hidden, inter)]


Linear = Callable[[torch.Tensor], torch.Tensor]


def step_ms(linears: list[list[Linear]], inputs: list[torch.Tensor]) -> float:
    """Milliseconds of one step: every layer's linears on their inputs, in layer order."""
    start = time.perf_counter()
    for layer in linears:
        for run, x in zip(layer, inputs, strict=True):
            run(x)
    return (time.perf_counter() - start) * 1e3


def gate_up_then_silu(x: torch.Tensor, weight: cpu_gemm.PackedWeight) -> torch.Tensor:
    """The gate|up GEMM, then the SiLU-and-mul kernel on its [M, 2I] output."""
    return cpu_fused.silu_mul(cpu_gemm.linear(x, weight, None))


def silu_systems(
    weights: list[list[torch.Tensor]], ours: list[list[cpu_gemm.PackedWeight]]
) -> dict[str, list[list[Linear]]]:
    """kvmesh's step with gate|up (the third linear) followed by SiLU-and-mul: as two calls,
    and in the GEMM's epilogue."""
    then: list[list[Linear]] = []
    epilogue: list[list[Linear]] = []
    for layer, packed in zip(weights, ours, strict=True):
        plain = [partial(cpu_gemm.linear, weight=p, bias=None) for p in packed]
        then.append([*plain[:2], partial(gate_up_then_silu, weight=packed[2]), plain[3]])
        fused = cpu_gemm.pack_gate_up(layer[2])
        epilogue.append([*plain[:2], partial(cpu_gemm.gate_up_silu, weight=fused), plain[3]])
    return {"kvmesh_then_silu": then, "kvmesh_silu_epilogue": epilogue}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 16, 32, 64, 128, 512, 2048])
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--hidden", type=int, default=576)
    parser.add_argument("--intermediate", type=int, default=1536)
    parser.add_argument("--heads", type=int, nargs=2, default=[9, 3], metavar=("Q", "KV"))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument(
        "--hot", action="store_true", help="every layer on the first layer's weights (in cache)"
    )
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--silu", action="store_true", help="gate|up + SiLU-and-mul, two ways")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    if not cpu_gemm.gemm_supported(dtype):
        raise SystemExit(f"this CPU or build does not run kvmesh's {args.dtype} GEMM")
    torch.set_num_threads(args.threads)
    shapes = layer_shapes(args.hidden, args.intermediate, *args.heads)
    generator = torch.Generator().manual_seed(0)
    distinct = 1 if args.hot else args.layers
    weights = [
        [torch.randn(shape, generator=generator).to(dtype) for shape in shapes]
        for _ in range(distinct)
    ] * (args.layers // distinct)
    ours = [[cpu_gemm.pack_weight(w) for w in layer] for layer in weights]
    systems: dict[str, list[list[Linear]]] = {
        "onednn": [[PackedLinear.from_weight(w, None).run for w in layer] for layer in weights],
        "kvmesh": [
            [partial(cpu_gemm.linear, weight=p, bias=None) for p in layer] for layer in ours
        ],
        "kvmesh_no_prefetch": [  # the same kernel with its weight prefetch off
            [partial(cpu_gemm.linear, weight=p, bias=None, prefetch=False) for p in layer]
            for layer in ours
        ],
    }
    if dtype == torch.float32:  # MKL's sgemm through F.linear: the float32 alternative
        systems["mkl"] = [[partial(F.linear, weight=w) for w in layer] for layer in weights]
    if args.silu:
        systems.update(silu_systems(weights, ours))
    flops_per_row = 2 * args.layers * sum(out * inp for out, inp in shapes)
    for rows in args.rows:
        inputs = [torch.randn(rows, inp, generator=generator).to(dtype) for _, inp in shapes]
        times = {name: float("inf") for name in systems}
        with torch.inference_mode():
            for _ in range(args.repeats):  # alternate, so both see the same machine
                for name, linears in systems.items():
                    times[name] = min(times[name], step_ms(linears, inputs))
        report = {
            "rows": rows,
            **{f"{name}_ms": round(ms, 2) for name, ms in times.items()},
            **{
                f"{name}_gflops": round(rows * flops_per_row / ms / 1e6)
                for name, ms in times.items()
            },
            **{
                f"{name}_over_kvmesh": round(ms / times["kvmesh"], 2)
                for name, ms in times.items()
                if name != "kvmesh"
            },
            **(
                {
                    "silu_epilogue_over_then_silu": round(
                        times["kvmesh_silu_epilogue"] / times["kvmesh_then_silu"], 3
                    )
                }
                if args.silu
                else {}
            ),
            "threads": args.threads,
            "weights": "hot" if args.hot else "cold",
            "dtype": args.dtype,
            **machine(),
        }
        print(json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
