"""`kvmesh bench throughput`: WORKLOADS.md's W1, W3 and W3-unique on the engine.

W1: 64 requests, all at time 0 (`random.Random(0)`; per request in order: prompt length
randint(32, 512), output length randint(16, 256), prompt ids randrange(10, vocab - 10)), greedy,
EOS ignored. `--baseline static|contiguous` runs that scheduler baseline in the same run;
`--compare-hf` adds transformers' static `generate` (left-padded batches) side by side.
W3: a 500-token system prompt (drawn first) + per request a suffix of randint(16, 128) ids, 32
output tokens; request i+1 arrives when request i has its first token. Prefix caching on and
off side by side. W3-unique: every prompt is fully random (no sharing).
Reported: tokens (generated), seconds (wall), tok_per_s, TTFT mean / p50 / p99 (seconds).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from typing import Any

WORKLOADS = ("W1", "W3", "W3-unique")
BASELINE_OPTIONS = {"static": {"policy": "static"}, "contiguous": {"allocation": "contiguous"}}


def register(subparsers: Any) -> None:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "throughput", help="engine throughput and TTFT on W1 / W3 / W3-unique"
    )
    parser.add_argument("--model", default=None, help="checkpoint folder (default: tiny model)")
    parser.add_argument("--workload", choices=WORKLOADS, default="W1")
    parser.add_argument("--baseline", choices=("static", "contiguous"), default=None)
    parser.add_argument("--compare-hf", action="store_true", help="W1: also transformers generate")
    parser.add_argument("--hf-batch-size", type=int, default=64)
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    parser.add_argument("--json", action="store_true", help="print results as JSON")
    parser.set_defaults(func=run_bench_throughput)


def w1_requests(vocab: int, count: int = 64) -> list[tuple[list[int], int]]:
    rng = random.Random(0)
    requests = []
    for _ in range(count):
        prompt_len, output_len = rng.randint(32, 512), rng.randint(16, 256)
        requests.append(([rng.randrange(10, vocab - 10) for _ in range(prompt_len)], output_len))
    return requests


def w3_requests(vocab: int, shared: bool, count: int = 64) -> list[tuple[list[int], int]]:
    rng = random.Random(0)
    system = [rng.randrange(10, vocab - 10) for _ in range(500)]
    requests = []
    for _ in range(count):
        head = system if shared else [rng.randrange(10, vocab - 10) for _ in range(500)]
        suffix = [rng.randrange(10, vocab - 10) for _ in range(rng.randint(16, 128))]
        requests.append((head + suffix, 32))
    return requests


def summarize(name: str, tokens: int, seconds: float, ttfts: list[float]) -> dict[str, Any]:
    ordered = sorted(ttfts)
    return {
        "name": name,
        "tokens": tokens,
        "seconds": round(seconds, 3),
        "tok_per_s": round(tokens / seconds, 2),
        "ttft_mean": round(statistics.fmean(ordered), 4) if ordered else None,
        "ttft_p50": round(ordered[len(ordered) // 2], 4) if ordered else None,
        "ttft_p99": round(ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))], 4)
        if ordered
        else None,
    }


def run_all_at_once(engine: Any, requests: list[tuple[list[int], int]]) -> tuple[int, float, list]:
    """Submit everything at time 0, step to the end; (tokens, seconds, ttfts)."""
    from kvmesh.engine.sampling_params import SamplingParams

    start = time.monotonic()
    for i, (prompt, out_len) in enumerate(requests):
        params = SamplingParams(temperature=0.0, max_tokens=out_len, ignore_eos=True)
        engine.add_request(f"w-{i}", prompt, params, arrival_time=start)
    return _drain(engine, start)


def run_one_by_one(engine: Any, requests: list[tuple[list[int], int]]) -> tuple[int, float, list]:
    """Request i + 1 arrives when request i has its first token."""
    from kvmesh.engine.sampling_params import SamplingParams

    start = time.monotonic()
    tokens, ttfts = 0, list[float]()
    for i, (prompt, out_len) in enumerate(requests):
        params = SamplingParams(temperature=0.0, max_tokens=out_len, ignore_eos=True)
        engine.add_request(f"w-{i}", prompt, params)
        has_first = False
        while not has_first:
            for output in engine.step():
                has_first |= output.request_id == f"w-{i}"
                tokens, ttfts = _account(output, tokens, ttfts)
    more_tokens, _, more_ttfts = _drain(engine, start)
    return tokens + more_tokens, time.monotonic() - start, ttfts + more_ttfts


def _drain(engine: Any, start: float) -> tuple[int, float, list]:
    tokens, ttfts = 0, list[float]()
    while engine.has_unfinished():
        for output in engine.step():
            tokens, ttfts = _account(output, tokens, ttfts)
    return tokens, time.monotonic() - start, ttfts


def _account(output: Any, tokens: int, ttfts: list) -> tuple[int, list]:
    if output.finished:
        tokens += len(output.outputs[0].token_ids)
        ttfts.append(output.metrics.ttft)
    return tokens, ttfts


def run_hf_static(model_dir: str, requests: list, batch_size: int) -> dict[str, Any]:
    """transformers `generate`, left-padded batches in request order, each to its longest."""
    import torch
    from transformers import AutoModelForCausalLM

    model: Any = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="sdpa")
    start = time.monotonic()
    for first in range(0, len(requests), batch_size):
        batch = requests[first : first + batch_size]
        width = max(len(p) for p, _ in batch)
        ids = torch.tensor([[0] * (width - len(p)) + p for p, _ in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in batch])
        longest = max(n for _, n in batch)
        with torch.inference_mode():
            model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=longest,
                min_new_tokens=longest,
                do_sample=False,
                pad_token_id=0,
            )
    tokens = sum(n for _, n in requests)  # useful tokens; padding rows do not count
    return summarize("transformers-static", tokens, time.monotonic() - start, [])


def run_bench_throughput(args: argparse.Namespace) -> int:
    import torch

    from kvmesh.engine.config import EngineConfig
    from kvmesh.engine.engine import LLMEngine
    from kvmesh.engine.loader import resolve_model_path

    torch.set_num_threads(args.threads)
    model_dir = str(resolve_model_path(args.model))
    runs: list[tuple[str, dict[str, Any]]] = []
    if args.workload == "W1":
        runs.append(("kvmesh", {}))
        if args.baseline:
            runs.append((f"kvmesh-{args.baseline}", BASELINE_OPTIONS[args.baseline]))
    else:
        runs += [("prefix-cache-on", {}), ("prefix-cache-off", {"enable_prefix_caching": False})]
    results = []
    for name, options in runs:
        engine = LLMEngine(EngineConfig(model=model_dir, **options))
        vocab = engine.runner.vocab_size
        if args.workload == "W1":
            tokens, seconds, ttfts = run_all_at_once(engine, w1_requests(vocab, args.num_requests))
        else:
            shared = args.workload == "W3"
            reqs = w3_requests(vocab, shared, args.num_requests)
            tokens, seconds, ttfts = run_one_by_one(engine, reqs)
        results.append(summarize(name, tokens, seconds, ttfts))
        del engine
    if args.workload == "W1" and args.compare_hf:
        reqs = w1_requests(_vocab(model_dir), args.num_requests)
        results.append(run_hf_static(model_dir, reqs, args.hf_batch_size))
    report = {"workload": args.workload, **results[0], "runs": results}
    report["ratios"] = {
        f"tok_per_s {results[0]['name']} / {r['name']}": round(
            results[0]["tok_per_s"] / r["tok_per_s"], 3
        )
        for r in results[1:]
    }
    if args.workload != "W1":
        on, off = results[0]["ttft_mean"], results[1]["ttft_mean"]
        report["ratios"]["ttft_mean on / off"] = round(on / off, 3)
    _print(report, args.json)
    return 0


def _vocab(model_dir: str) -> int:
    from transformers import AutoConfig

    return int(AutoConfig.from_pretrained(model_dir, local_files_only=True).vocab_size)


def _print(report: dict[str, Any], as_json: bool) -> None:
    if as_json:
        print(json.dumps(report))
        return
    print(f"workload {report['workload']}")
    for run in report["runs"]:
        print(
            f"  {run['name']:<22} {run['tokens']:>7} tok {run['seconds']:>8.2f} s "
            f"{run['tok_per_s']:>9.2f} tok/s  TTFT mean {run['ttft_mean']} p50 {run['ttft_p50']} "
            f"p99 {run['ttft_p99']}"
        )
    for name, ratio in report["ratios"].items():
        print(f"  {name}: {ratio}")
