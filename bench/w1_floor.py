"""W1's matmul floor as the engine schedules it: the same steps' linears, and nothing else.

Runs W1 once on the engine (64 requests, greedy, exact output lengths) and records every
step's shape: tokens in the flat batch and rows sampled. Then replays only the matmuls of those
steps on weights of the model's shapes, the way the engine runs them (its linear kind:
kvmesh's CPU GEMM, oneDNN-packed or `F.linear`): per layer q, k, v, o, gate, up, down on
[tokens, in], plus `lm_head` on [sampled, hidden]. The replay's wall time is the floor the
model's arithmetic and weight traffic set for this schedule on this machine; the engine's wall
time over it says how much goes elsewhere (attention, elementwise ops, Python).

Attention cannot go below reading each scheduled sequence's K/V once per step: the script also
counts those bytes (every sequence's context, every layer, K and V at the cache's dtype) and
times reading that many bytes two ways. `floor_with_kv_read_*` reads them at the machine's
streaming read rate (a dot product over a 512 MiB buffer, best of three), which no paged
cache reaches: its blocks lie scattered in memory. `floor_with_paged_kv_read_*` reads them at
the rate this machine reads the engine's own cache through block tables
(`kvmesh_kernels.cpu_kv_read`: W1-sized sequences of 32 blocks in random order, every layer in
turn, the attention kernel's prefetch, best of three): the floor of a step that does nothing
but its GEMMs and one pass over its paged KV.

The replayed linears are the executor's: q, k, v, o, gate, up, down for transformers' modules,
the merged qkv, o, gate_up, down for the native executor (fewer, larger GEMMs raise the floor).

Run: `.venv/bin/python bench/w1_floor.py --dtype bfloat16 [--model DIR] [--executor E]`
(prints one JSON line).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from kvmesh.cli.main import apply_omp_defaults

apply_omp_defaults()  # before torch loads OpenMP, as every kvmesh command

import torch  # noqa: E402
from kvmesh_kernels import cpu_kv_read  # noqa: E402
from kvmesh_kernels.cache import PagedKVCache  # noqa: E402

from kvmesh.cli.bench_throughput import WARMUP_PROMPT, run_all_at_once, w1_requests  # noqa: E402
from kvmesh.engine.config import EngineConfig  # noqa: E402
from kvmesh.engine.cpu_linear import CpuGemmLinear, PackedLinear  # noqa: E402
from kvmesh.engine.engine import LLMEngine  # noqa: E402
from kvmesh.engine.native.layers import direct_call, make_linear  # noqa: E402

MODEL = Path.home() / ".cache" / "kvmesh" / "models" / "tiny-llama-bench-seed0"


def record_w1(engine: LLMEngine) -> tuple[list[tuple[int, int, int]], float, int]:
    """Run W1; returns ([(tokens, sampled, context tokens) per step], engine seconds, generated
    tokens); context tokens: the KV positions the step's sequences attend to, summed."""
    shapes: list[tuple[int, int, int]] = []
    execute = engine.runner.execute

    def recording(plan: Any) -> torch.Tensor:
        context = sum(plan.start_positions) + len(plan.token_ids)
        shapes.append((len(plan.token_ids), plan.num_sampled_rows, context))
        return execute(plan)

    engine.runner.execute = recording  # type: ignore[method-assign]
    generated, seconds, _ = run_all_at_once(engine, w1_requests(engine.runner.vocab_size))
    engine.runner.execute = execute  # type: ignore[method-assign]
    return shapes, seconds, generated


def layer_shapes(config: Any, merged: bool) -> list[tuple[int, int]]:
    """(out, in) of one decoder layer's linears, in call order: q, k, v, o, gate, up, down
    (transformers' modules) or qkv, o, gate_up, down (`merged`: the native executor)."""
    hidden, inter = int(config.hidden_size), int(config.intermediate_size)
    heads, kv_heads = int(config.num_attention_heads), int(config.num_key_value_heads)
    head_dim = int(getattr(config, "head_dim", None) or hidden // heads)
    q, kv = heads * head_dim, kv_heads * head_dim
    if merged:
        return [(q + 2 * kv, hidden), (hidden, q), (2 * inter, hidden), (hidden, inter)]
    attention = [(q, hidden), (kv, hidden), (kv, hidden), (hidden, q)]
    return [*attention, (inter, hidden), (inter, hidden), (hidden, inter)]


def read_bytes_per_second(mib: int = 512) -> float:
    """Streaming read rate: a float32 vector's dot product with itself over `mib` MiB (each
    element read once; torch's `sum` is compute-bound here), best of three."""
    buffer = torch.ones(mib * (1 << 20) // 4, dtype=torch.float32)
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        torch.dot(buffer, buffer)
        best = min(best, time.perf_counter() - start)
    return buffer.numel() * 4 / best


def paged_read_bytes_per_second(
    cache: PagedKVCache, blocks_per_seq: int = 32, max_seqs: int = 64
) -> float | None:
    """The rate of reading `cache` through block tables: up to max_seqs sequences of
    blocks_per_seq whole blocks in random order (fewer when the cache is smaller), every layer
    in turn, best of three; None where the CPU kernel library is unavailable."""
    if not cpu_kv_read.available():
        return None
    spec = cache.spec
    seqs = max(1, min(max_seqs, spec.num_blocks // blocks_per_seq))
    width = min(blocks_per_seq, spec.num_blocks)
    order = torch.randperm(spec.num_blocks, generator=torch.Generator().manual_seed(0))
    tables = order[: seqs * width].to(torch.int32).reshape(seqs, width)  # [seqs, width]
    lens = torch.full((seqs,), width * spec.block_size, dtype=torch.int32)
    layers = [cache.layer(i) for i in range(spec.num_layers)]
    read = seqs * width * spec.bytes_per_block  # every layer's K and V of those blocks
    times = []
    for _ in range(3):
        start = time.perf_counter()
        for layer in layers:
            cpu_kv_read.read_kv(layer, tables, lens)
        times.append(time.perf_counter() - start)
    return read / min(times)


def replay(
    shapes: list[tuple[int, int, int]],
    config: Any,
    dtype: torch.dtype,
    merged: bool,
    kind: str,
) -> float:
    """Seconds for the recorded steps' matmuls alone, on the engine's linear kind
    (`native.layers.make_linear`: kvmesh's CPU GEMM, oneDNN-packed or `F.linear`)."""
    layers = [layer_shapes(config, merged) for _ in range(int(config.num_hidden_layers))]
    weights = [
        [direct_call(make_linear(torch.randn(o, i, dtype=dtype), None, kind)) for o, i in layer]
        for layer in layers
    ]
    head_weight = torch.randn(int(config.vocab_size), int(config.hidden_size), dtype=dtype)
    head = direct_call(make_linear(head_weight, None, kind))
    widest = max(tokens for tokens, _, _ in shapes)
    inputs = {i: torch.randn(widest, i, dtype=dtype) for i in {i for o, i in layers[0]}}
    start = time.perf_counter()
    with torch.inference_mode():
        for tokens, sampled, _ in shapes:
            for layer, linears in zip(layers, weights, strict=True):
                for (_, width), linear in zip(layer, linears, strict=True):
                    linear(inputs[width][:tokens])
            if sampled:
                head(inputs[int(config.hidden_size)][:sampled])
    return time.perf_counter() - start


def linear_kind(model: torch.nn.Module) -> str:
    """The linear kind the loaded model runs (the first linear module's)."""
    for module in model.modules():
        if isinstance(module, CpuGemmLinear):
            return "kvmesh"
        if isinstance(module, PackedLinear):
            return "onednn"
    return "plain"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(MODEL))
    parser.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--executor", default="auto", choices=("auto", "native", "transformers"))
    args = parser.parse_args()
    config = EngineConfig(
        model=args.model, dtype=args.dtype, num_threads=args.threads, executor=args.executor
    )
    engine = LLMEngine(config)
    run_all_at_once(engine, [WARMUP_PROMPT])
    shapes, engine_seconds, generated = record_w1(engine)
    loaded = engine.runner.loaded
    merged = loaded.executor == "native"
    kind = linear_kind(loaded.model)
    floor = min(replay(shapes, loaded.hf_config, loaded.dtype, merged, kind) for _ in range(2))
    spec = engine.runner.kv_cache.spec  # the cache's own dtype (and scales, when quantized)
    kv_bytes = sum(c for _, _, c in shapes) * (spec.bytes_per_block // spec.block_size)
    read_rate = read_bytes_per_second()
    with_kv = floor + kv_bytes / read_rate
    paged_rate = paged_read_bytes_per_second(engine.runner.kv_cache)
    paged: dict[str, float | None] = {"paged_read_gb_per_s": None}
    if paged_rate is not None:
        with_paged = floor + kv_bytes / paged_rate
        paged = {
            "paged_read_gb_per_s": round(paged_rate / 1e9, 2),
            "floor_with_paged_kv_read_seconds": round(with_paged, 3),
            "floor_with_paged_kv_read_tok_per_s": round(generated / with_paged, 1),
            "engine_share_of_floor_with_paged_kv_read": round(with_paged / engine_seconds, 3),
        }
    print(
        json.dumps(
            {
                "dtype": args.dtype,
                "executor": loaded.executor,
                "linears": kind,
                "steps": len(shapes),
                "generated_tokens": generated,
                "engine_seconds": round(engine_seconds, 3),
                "engine_tok_per_s": round(generated / engine_seconds, 1),
                "matmul_floor_seconds": round(floor, 3),
                "floor_tok_per_s": round(generated / floor, 1),
                "engine_share_of_floor": round(floor / engine_seconds, 3),
                "kv_read_gb": round(kv_bytes / 1e9, 2),
                "read_gb_per_s": round(read_rate / 1e9, 2),
                "floor_with_kv_read_seconds": round(with_kv, 3),
                "floor_with_kv_read_tok_per_s": round(generated / with_kv, 1),
                "engine_share_of_floor_with_kv_read": round(with_kv / engine_seconds, 3),
                **paged,
            }
        )
    )


if __name__ == "__main__":
    main()
