"""`kvmesh bench throughput`: W1, W3 and W3-unique (docs/BENCHMARK_SUITE.md) on the engine.

W1: 64 requests, all at time 0 (`random.Random(0)`; per request in order: prompt length
randint(32, 512), output length randint(16, 256), prompt ids randrange(10, vocab - 10)), greedy,
EOS ignored. `--baseline static|contiguous` runs that scheduler baseline in the same run;
`--compare-hf` adds transformers' static `generate` (left-padded batches), `--compare-hf-cb`
transformers' continuous batching (`init_continuous_batching`: its paged cache and scheduler,
SDPA, kvmesh's per-step token budget; every request capped at its own length, checked) and
`--compare-vllm PYTHON` runs `bench/vllm_bench.py` with that interpreter (vLLM's CPU build in
its own virtual environment) as a subprocess, side by side in the same run (W3 / W3-unique:
vLLM with its prefix caching on and off, the same arrivals, TTFT ratios against kvmesh's);
`--repeats R` runs every system R times back to back (interleaved) and reports each ratio's
median and range.
Every system gets one short warm-up request first (prompt ids that W1 never draws first, so no
prefix-cache hits) and the same thread count and the same OpenMP wait setting
(`kvmesh.cli.main.apply_omp_defaults`: a bounded spin unless OMP_WAIT_POLICY or GOMP_SPINCOUNT
is set).
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
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from kvmesh.cli.main import apply_omp_defaults
from kvmesh.engine.config import COMPILE_MODES, CPU_GEMMS, SCHEDULING_POLICIES, EngineConfig

WORKLOADS = ("W1", "W3", "W3-unique")
BASELINE_OPTIONS = {"static": {"policy": "static"}, "contiguous": {"allocation": "contiguous"}}
VLLM_SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "vllm_bench.py"
WARMUP_PROMPT = ([11] * 64, 8)  # never a W1 / W3 prefix (their ids are random)


def register(subparsers: Any) -> None:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "throughput", help="engine throughput and TTFT on W1 / W3 / W3-unique"
    )
    parser.add_argument("--model", default=None, help="checkpoint folder (default: tiny model)")
    parser.add_argument("--workload", choices=WORKLOADS, default="W1")
    parser.add_argument("--baseline", choices=("static", "contiguous"), default=None)
    parser.add_argument("--compare-hf", action="store_true", help="W1: also transformers generate")
    parser.add_argument("--hf-batch-size", type=int, default=64)
    parser.add_argument(
        "--compare-hf-cb",
        action="store_true",
        help="W1: also transformers' continuous batching (init_continuous_batching, SDPA, "
        "--max-num-batched-tokens per step as kvmesh's)",
    )
    parser.add_argument(
        "--compare-vllm",
        metavar="PYTHON",
        default=None,
        help="also vLLM (W3: with its prefix caching on and off), run as bench/vllm_bench.py "
        "under this interpreter (its own venv)",
    )
    parser.add_argument("--repeats", type=int, default=1, help="run every system N times")
    parser.add_argument(
        "--dtype",
        choices=("auto", "float32", "bfloat16", "float16"),
        default="auto",
        help="model dtype for every system (auto: each system's default; vLLM's CPU build "
        "then runs a float32 checkpoint in bfloat16)",
    )
    parser.add_argument("--max-num-seqs", type=int, default=None)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None)
    parser.add_argument(
        "--scheduling-policy",
        choices=SCHEDULING_POLICIES,
        default=None,
        help="kvmesh's step order (default: the engine's, decode-first)",
    )
    parser.add_argument(
        "--executor",
        choices=("auto", "native", "transformers"),
        default="auto",
        help="kvmesh's model code (kvmesh.engine.executor)",
    )
    parser.add_argument(
        "--compare-executors",
        action="store_true",
        help="W1: also kvmesh with transformers' model code (executor=transformers)",
    )
    parser.add_argument(
        "--compile",
        choices=COMPILE_MODES,
        default=None,
        help="native executor: torch.compile of the per-layer math (default: the engine's)",
    )
    parser.add_argument(
        "--cpu-gemm",
        choices=CPU_GEMMS,
        default=None,
        help="native executor on CPU: the linears' GEMM (default: the engine's, auto)",
    )
    parser.add_argument(
        "--compare-cpu-gemm",
        action="store_true",
        help="W1: also kvmesh with torch's GEMM for the linears (kvmesh-torch-gemm)",
    )
    parser.add_argument(
        "--compare-compile",
        action="store_true",
        help="W1: also kvmesh with the other --compile mode (kvmesh-compile-on / -off)",
    )
    parser.add_argument(
        "--compare-decode-program",
        action="store_true",
        help="also kvmesh with every CPU step made call by call from Python (decode_program "
        "off; W1: kvmesh-eager-decode, W3: prefix-cache-on-eager and prefix-cache-off-eager)",
    )
    parser.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="kvmesh and vLLM sample at this temperature, unseeded (default 0: greedy; the "
        "transformers paths stay greedy and are refused with it)",
    )
    parser.add_argument("--top-p", type=float, default=1.0, help="with --temperature: top_p")
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


GREEDY = (0.0, 1.0)  # (temperature, top_p)


def bench_params(out_len: int, sampling: tuple[float, float] = GREEDY) -> Any:
    """Greedy unless `sampling` (temperature, top_p) says otherwise, EOS ignored, exactly
    `out_len` tokens, ids only: vLLM runs with `skip_tokenizer_init=True` and transformers'
    `generate` returns ids, so no system detokenizes."""
    from kvmesh.engine.sampling_params import SamplingParams

    temperature, top_p = sampling
    return SamplingParams(
        temperature=temperature, top_p=top_p, max_tokens=out_len, ignore_eos=True,
        detokenize=False,
    )  # fmt: skip


def run_all_at_once(
    engine: Any, requests: list[tuple[list[int], int]], sampling: tuple[float, float] = GREEDY
) -> tuple[int, float, list]:
    """Submit everything at time 0, step to the end; (tokens, seconds, ttfts)."""
    start = time.monotonic()
    for i, (prompt, out_len) in enumerate(requests):
        params = bench_params(out_len, sampling)
        engine.add_request(f"w-{i}", prompt, params, arrival_time=start)
    return _drain(engine, start)


def run_one_by_one(engine: Any, requests: list[tuple[list[int], int]]) -> tuple[int, float, list]:
    """Request i + 1 arrives when request i has its first token. Each TTFT is timed as
    bench/vllm_bench.py times vLLM's: from just before `add_request` to the return of the
    `step()` that gave the request its first token (the engine's own `metrics.ttft` starts
    inside `add_request` and ends inside the step, which would favour kvmesh)."""
    start = time.monotonic()
    tokens, ttfts = 0, list[float]()
    for i, (prompt, out_len) in enumerate(requests):
        request_id = f"w-{i}"
        params = bench_params(out_len)
        added = time.monotonic()
        engine.add_request(request_id, prompt, params)
        has_first = False
        while not has_first:
            outputs = engine.step()
            has_first = any(
                o.request_id == request_id and o.outputs and o.outputs[0].token_ids for o in outputs
            )
            for output in outputs:
                tokens, _ = _account(output, tokens, [])
        ttfts.append(time.monotonic() - added)
    more_tokens, _, _ = _drain(engine, start)
    return tokens + more_tokens, time.monotonic() - start, ttfts


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


def run_hf_static(model_dir: str, requests: list, batch_size: int, dtype: str) -> dict[str, Any]:
    """transformers `generate`, left-padded batches in request order, each to its longest."""
    from transformers import AutoModelForCausalLM

    model: Any = AutoModelForCausalLM.from_pretrained(
        model_dir, attn_implementation="sdpa", dtype=dtype
    )
    _hf_generate(model, [WARMUP_PROMPT], 1)
    start = time.monotonic()
    _hf_generate(model, requests, batch_size)
    tokens = sum(n for _, n in requests)  # useful tokens; padding rows do not count
    result = summarize("transformers-static", tokens, time.monotonic() - start, [])
    dtype_name = str(model.dtype).removeprefix("torch.")
    return {**result, "dtype": dtype_name, "executor": "transformers-generate"}


def _hf_generate(model: Any, requests: list, batch_size: int) -> None:
    import torch

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


def run_hf_cb(
    model_dir: str, requests: list, dtype: str, max_batch_tokens: int | None = None
) -> dict[str, Any]:
    """transformers' continuous batching (`init_continuous_batching`: a paged cache and a FIFO
    scheduler in a background thread), SDPA attention, greedy, EOS off (`eos_token_id=-1`), each
    request capped at its own length; every request in, in order, at time 0. One warm-up request
    through the same manager first. Raises if a request fails or ends at another length.

    The cache is sized here, not by transformers: on CPU its default takes 60% of the host RAM
    the process does not use, with 8192-token steps and an SDPA mask of 8192 x (every cached
    token + 8192) (9.3 GiB in float32 for the bench model on a 24 GB host). Here: pages for
    every request at once, `max_batch_tokens` per step (default: kvmesh's default)."""
    from transformers import AutoModelForCausalLM

    model: Any = AutoModelForCausalLM.from_pretrained(
        model_dir, attn_implementation="sdpa", dtype=dtype
    )
    budget = max_batch_tokens or EngineConfig.max_num_batched_tokens
    with hf_cb_manager(model, requests, budget) as manager:
        hf_cb_generate(manager, [WARMUP_PROMPT], "warmup")
        start = time.perf_counter()
        outputs = hf_cb_generate(manager, requests, "w")
        seconds = time.perf_counter() - start
    tokens = sum(n for _, n in requests)  # checked request by request in hf_cb_generate
    ttfts = [output.timestamps[0] - start for output in outputs]
    result = summarize("transformers-cb", tokens, seconds, ttfts)
    dtype_name = str(model.dtype).removeprefix("torch.")
    return {**result, "dtype": dtype_name, "executor": "transformers-continuous-batching"}


@contextmanager
def hf_cb_manager(model: Any, requests: list, max_batch_tokens: int) -> Iterator[Any]:
    """transformers' continuous batching manager of `model`, started for `requests` (greedy, EOS
    off, cache from `_hf_cb_config`) in inference mode, which its thread takes from the caller;
    stopped and destroyed on exit."""
    import torch
    from transformers import GenerationConfig

    generation = GenerationConfig(do_sample=False, eos_token_id=-1, max_new_tokens=1)
    batching = _hf_cb_config(requests, max_batch_tokens)
    with torch.inference_mode():
        manager = model.init_continuous_batching(generation, batching)
        manager.start()
        try:
            yield manager
        finally:
            manager.stop(block=True)
            manager.destroy()


def _hf_cb_config(requests: list, max_batch_tokens: int) -> Any:
    """Pages for every request (and the warm-up) at once, default page size."""
    from transformers import ContinuousBatchingConfig

    page = ContinuousBatchingConfig.page_size
    pages = sum(-(-(len(p) + n) // page) for p, n in [*requests, WARMUP_PROMPT])
    return ContinuousBatchingConfig(
        num_blocks=pages, max_batch_tokens=max_batch_tokens, auto_switch_to_flash=False
    )


def hf_cb_generate(manager: Any, requests: list, prefix: str) -> list[Any]:
    """Add every request (ids `prefix-i`, EOS off, token timestamps on), wait for all of them;
    their `GenerationOutput`s in request order. Raises RuntimeError on a failed request, a dead
    manager thread or a length other than the request's."""
    wanted = {}
    for i, (prompt, out_len) in enumerate(requests):
        request_id = f"{prefix}-{i}"
        manager.add_request(
            prompt, request_id, max_new_tokens=out_len, eos_token_id=-1, record_timestamps=True
        )
        wanted[request_id] = out_len
    done: dict[str, Any] = {}
    while len(done) < len(wanted):
        result = manager.get_result(timeout=1.0)
        if result is None:
            if not manager.is_running():
                error = manager.background_thread_status.fatal_error
                raise RuntimeError(f"transformers' batching thread stopped: {error!r}")
            continue
        if result.is_finished():
            done[result.request_id] = result
    for request_id, result in done.items():
        got = len(result.generated_tokens)
        if result.error is not None or got != wanted[request_id]:
            raise RuntimeError(f"{request_id}: {got} of {wanted[request_id]} ({result.error})")
    return [done[request_id] for request_id in wanted]


def run_vllm(
    python: str, model_dir: str, args: Any, workload: str = "W1", prefix_caching: str = "on"
) -> dict[str, Any]:
    """bench/vllm_bench.py under another interpreter; the result is its `{"name": "vllm", ...}`
    stdout line (vLLM logs to stdout too), summarized like kvmesh's runs."""
    command = [python, str(VLLM_SCRIPT), "--model", model_dir, "--dtype", args.dtype]
    command += ["--num-requests", str(args.num_requests), "--threads", str(args.threads)]
    command += ["--workload", workload, "--prefix-caching", prefix_caching]
    command += ["--temperature", str(args.temperature), "--top-p", str(args.top_p)]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    lines = [line for line in done.stdout.splitlines() if line.startswith('{"name": "vllm"')]
    if done.returncode != 0 or not lines:
        tail = (done.stderr or done.stdout)[-2000:]
        raise RuntimeError(f"vLLM run failed (exit {done.returncode}):\n{tail}")
    result = json.loads(lines[-1])
    name = "vllm" if workload == "W1" else f"vllm-prefix-cache-{prefix_caching}"
    ttfts = [float(t) for t in result.get("ttfts", [])]
    summary = summarize(name, int(result["tokens"]), float(result["seconds"]), ttfts)
    return {**summary, "dtype": result["dtype"], "executor": "vllm"}


def run_kvmesh(model_dir: str, workload: str, name: str, options: dict, args: Any) -> dict:
    from kvmesh.engine.engine import LLMEngine

    knobs = ("max_num_seqs", "max_num_batched_tokens", "scheduling_policy", "compile", "cpu_gemm")
    for knob in knobs:
        if getattr(args, knob, None) is not None:
            options = {knob: getattr(args, knob), **options}
    options = {"executor": args.executor, **options}
    config = EngineConfig(model=model_dir, num_threads=args.threads, dtype=args.dtype, **options)
    engine = LLMEngine(config)
    vocab = engine.runner.vocab_size
    run_all_at_once(engine, [WARMUP_PROMPT])
    if workload == "W1":
        reqs = w1_requests(vocab, args.num_requests)
        tokens, seconds, ttfts = run_all_at_once(engine, reqs, (args.temperature, args.top_p))
    else:
        reqs = w3_requests(vocab, workload == "W3", args.num_requests)
        tokens, seconds, ttfts = run_one_by_one(engine, reqs)
    dtype = str(engine.runner.loaded.dtype).removeprefix("torch.")
    policy = config.scheduling_policy
    executor = engine.runner.loaded.executor
    summary = summarize(name, tokens, seconds, ttfts)
    return {
        **summary,
        "dtype": dtype,
        "scheduling_policy": policy,
        "executor": executor,
        "linears": engine.runner.loaded.linears,
        "compile": config.compile,
        "decode_program": engine.runner.decode_program is not None,
    }


def run_bench_throughput(args: argparse.Namespace) -> int:
    if "torch" in sys.modules:
        print("warning: torch already imported; OpenMP wait defaults not applied", file=sys.stderr)
    apply_omp_defaults()  # read when torch loads OpenMP; the vLLM subprocess inherits it
    import torch

    from kvmesh.engine.loader import resolve_model_path
    from kvmesh.models.tiny import tiny_model_path

    if args.temperature > 0 and (args.compare_hf or args.compare_hf_cb or args.workload != "W1"):
        raise SystemExit("--temperature: W1 only, without the transformers paths (greedy)")
    torch.set_num_threads(args.threads)
    model_dir = str(resolve_model_path(args.model) if args.model else tiny_model_path())
    runs: list[tuple[str, dict[str, Any]]] = []
    if args.workload == "W1":
        runs.append(("kvmesh", {}))
        if args.baseline:
            runs.append((f"kvmesh-{args.baseline}", BASELINE_OPTIONS[args.baseline]))
        if args.compare_executors:
            runs.append(("kvmesh-transformers", {"executor": "transformers"}))
        if args.compare_cpu_gemm:
            runs.append(("kvmesh-torch-gemm", {"cpu_gemm": "torch"}))
        if args.compare_decode_program:
            runs.append(("kvmesh-eager-decode", {"decode_program": False}))
        if args.compare_compile:
            other = "on" if (args.compile or EngineConfig.compile) == "off" else "off"
            runs.append((f"kvmesh-compile-{other}", {"compile": other}))
    else:
        runs += [("prefix-cache-on", {}), ("prefix-cache-off", {"enable_prefix_caching": False})]
        if args.compare_decode_program:
            runs += [(f"{name}-eager", {**o, "decode_program": False}) for name, o in runs[:2]]
    repeats: list[list[dict[str, Any]]] = []
    for _ in range(args.repeats):
        results = [run_kvmesh(model_dir, args.workload, n, o, args) for n, o in runs]
        if args.workload == "W1" and (args.compare_hf or args.compare_hf_cb):
            reqs = w1_requests(_vocab(model_dir), args.num_requests)
            if args.compare_hf:
                results.append(run_hf_static(model_dir, reqs, args.hf_batch_size, args.dtype))
            if args.compare_hf_cb:
                budget = args.max_num_batched_tokens
                results.append(run_hf_cb(model_dir, reqs, args.dtype, budget))
        if args.workload == "W1" and args.compare_vllm:
            results.append(run_vllm(args.compare_vllm, model_dir, args))
        elif args.compare_vllm:
            for caching in ("on", "off"):
                results.append(run_vllm(args.compare_vllm, model_dir, args, args.workload, caching))
        repeats.append(results)
        print(json.dumps({"repeat": len(repeats), "runs": results}), file=sys.stderr)
    report = _report(args.workload, repeats)
    _print(report, args.json)
    return 0


def _ratios(workload: str, results: list[dict[str, Any]]) -> dict[str, float]:
    first = results[0]
    ratios = {
        f"tok_per_s {first['name']} / {r['name']}": round(first["tok_per_s"] / r["tok_per_s"], 3)
        for r in results[1:]
    }
    if workload != "W1":
        ratios["ttft_mean on / off"] = round(first["ttft_mean"] / results[1]["ttft_mean"], 3)
        by_name = {r["name"]: r for r in results}
        if "prefix-cache-on-eager" in by_name:
            on, off = by_name["prefix-cache-on-eager"], by_name["prefix-cache-off-eager"]
            ratios["ttft_mean on / off, eager steps"] = round(on["ttft_mean"] / off["ttft_mean"], 3)
        for caching in ("on", "off"):
            theirs = by_name.get(f"vllm-prefix-cache-{caching}")
            if theirs is not None:
                ours = by_name[f"prefix-cache-{caching}"]
                key = f"ttft_mean prefix-cache-{caching} / vllm-prefix-cache-{caching}"
                ratios[key] = round(ours["ttft_mean"] / theirs["ttft_mean"], 3)
    return ratios


def _report(workload: str, repeats: list[list[dict[str, Any]]]) -> dict[str, Any]:
    """The first repeat's runs and ratios; with several repeats, every ratio's median and range."""
    from kvmesh_kernels.cpu_build import machine

    report: dict[str, Any] = {"workload": workload, **repeats[0][0], "runs": repeats[0]}
    report["machine"] = machine()
    report["ratios"] = _ratios(workload, repeats[0])
    if len(repeats) > 1:
        per_repeat = [_ratios(workload, results) for results in repeats]
        report["repeats"] = [
            {r["name"]: r["tok_per_s"] for r in results} | {"ratios": ratios}
            for results, ratios in zip(repeats, per_repeat, strict=True)
        ]
        report["ratios"] = {
            key: statistics.median(r[key] for r in per_repeat) for key in per_repeat[0]
        }
        report["ratio_range"] = {
            key: [min(r[key] for r in per_repeat), max(r[key] for r in per_repeat)]
            for key in per_repeat[0]
        }
    return report


def _vocab(model_dir: str) -> int:
    from transformers import AutoConfig

    return int(AutoConfig.from_pretrained(model_dir, local_files_only=True).vocab_size)


def _print(report: dict[str, Any], as_json: bool) -> None:
    if as_json:
        print(json.dumps(report))
        return
    from kvmesh_kernels.cpu_build import isa_text

    host = report["machine"]
    print(f"workload {report['workload']} on {host['cpu']} ({isa_text(host)})")
    for run in report["runs"]:
        print(
            f"  {run['name']:<22} {run['tokens']:>7} tok {run['seconds']:>8.2f} s "
            f"{run['tok_per_s']:>9.2f} tok/s {run.get('dtype', '')} TTFT mean {run['ttft_mean']} "
            f"p50 {run['ttft_p50']} p99 {run['ttft_p99']}"
        )
    for repeat in report.get("repeats", []):
        print(f"  repeat: {repeat}")
    spread = report.get("ratio_range", {})
    for name, ratio in report["ratios"].items():
        extra = f" (range {spread[name][0]}-{spread[name][1]})" if name in spread else ""
        print(f"  {name}: {ratio}{extra}")
