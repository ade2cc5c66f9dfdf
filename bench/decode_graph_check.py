"""GPU check, decode CUDA graphs: graph replay against eager decode steps in one process.

Run by bench/gpu_check.py. The bench-size tiny Llama (test size in a dry run) generates the
same greedy batch twice, once with `cuda_graphs` off and once on (captured at start for
batch-size buckets up to `max_num_seqs`); reported: whether every sequence's tokens are
identical, the median decode-step time of each (`ModelRunner.execute`, synchronized), and
their ratio. In a dry run (CPU) the graph side is the padded static-buffer step run eagerly
(`capture=False`): a smoke test of the code path, not a measurement.
"""

from __future__ import annotations

import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def decode_graph_check(device: torch.device, dry: bool) -> dict[str, Any]:
    from kvmesh import LLM, SamplingParams
    from kvmesh.models.tiny import tiny_model_path

    model = str(tiny_model_path("test" if dry else "bench"))
    batch, new_tokens = (3, 4) if dry else (48, 64)  # 48 pads to bucket 48; 47..1 as they end
    rng = random.Random(0)
    prompts = [[rng.randrange(10, 1000) for _ in range(rng.randint(16, 64))] for _ in range(batch)]
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    runs: dict[str, Any] = {}
    for mode in ("eager", "graphs"):
        graphs = mode == "graphs" and device.type == "cuda"
        llm = LLM(model, device=device.type, dtype="float32", max_num_seqs=64, cuda_graphs=graphs)
        runner = llm.engine.runner
        if mode == "graphs" and device.type != "cuda":
            runner.enable_decode_graphs(64, capture=False)
        times = time_decode_steps(runner, device)
        llm.generate([prompts[0][:8]], SamplingParams(temperature=0.0, max_tokens=2))
        times.clear()  # warm-up above
        outputs = llm.generate(prompts, params)
        replays = runner.decode_graphs.replays if runner.decode_graphs is not None else 0
        runs[mode] = {
            "tokens": [list(o.outputs[0].token_ids) for o in outputs],
            "decode_step_ms": statistics.median(times) * 1e3 if times else None,
            "decode_steps": len(times),
            "replays": replays,
        }
        del llm, runner
        if device.type == "cuda":
            torch.cuda.empty_cache()
    eager, graphs = runs["eager"], runs["graphs"]
    same = sum(a == b for a, b in zip(eager["tokens"], graphs["tokens"], strict=True))
    result = {
        "model": "tiny-llama-" + ("test" if dry else "bench"),
        "sequences": batch,
        "new_tokens": new_tokens,
        "identical_sequences": same,
        "tokens_identical": same == batch,
        "eager_step_ms": eager["decode_step_ms"],
        "graph_step_ms": graphs["decode_step_ms"],
        "graph_replays": graphs["replays"],
    }
    if eager["decode_step_ms"] and graphs["decode_step_ms"]:
        result["eager_over_graph"] = eager["decode_step_ms"] / graphs["decode_step_ms"]
    return result


def time_decode_steps(runner: Any, device: torch.device) -> list[float]:
    """Wrap `runner.execute` to record the seconds of every decode-only step."""
    times: list[float] = []
    execute = runner.execute

    def timed(plan: Any) -> torch.Tensor:
        decode = plan.num_decodes == len(plan.seq_ids)
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        out = execute(plan)
        if device.type == "cuda":
            torch.cuda.synchronize()
        if decode:
            times.append(time.perf_counter() - start)
        return out  # type: ignore[no-any-return]

    runner.execute = timed
    return times


def summary_line(result: dict[str, Any]) -> str:
    if "error" in result:
        return f"decode graphs: failed: {result['error']}"
    ratio = result.get("eager_over_graph")
    return (
        f"decode graphs ({result['model']}, {result['sequences']} seqs): tokens identical "
        f"{result['identical_sequences']}/{result['sequences']}, step eager "
        f"{result['eager_step_ms']:.2f} ms vs graph {result['graph_step_ms']:.2f} ms"
        + (f" ({ratio:.2f}x)" if ratio else "")
    )
