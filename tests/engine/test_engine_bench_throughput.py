"""`kvmesh bench throughput`: the vLLM side's W1 generator matches kvmesh's; ratio report."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

from kvmesh.cli import bench_throughput
from kvmesh.cli.bench_throughput import (
    _report,
    hf_cb_generate,
    hf_cb_manager,
    w1_requests,
    w3_requests,
)

VLLM_SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "vllm_bench.py"


def _load_vllm_script():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("vllm_bench", VLLM_SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_vllm_script_draws_the_same_w1_requests() -> None:
    assert bench_throughput.VLLM_SCRIPT == VLLM_SCRIPT
    theirs = _load_vllm_script().w1_requests(32000, 64)
    assert theirs == w1_requests(32000, 64)
    assert sum(len(p) for p, _ in theirs) == 17725
    assert sum(n for _, n in theirs) == 8885


def test_vllm_script_draws_the_same_w3_requests() -> None:
    script = _load_vllm_script()
    for shared in (True, False):
        assert script.w3_requests(32000, shared, 64) == w3_requests(32000, shared, 64)
    shared_heads = {tuple(p[:500]) for p, _ in w3_requests(32000, True, 64)}
    assert len(shared_heads) == 1


def test_warmup_prompt_is_no_w1_prefix() -> None:
    prompt, _ = bench_throughput.WARMUP_PROMPT
    assert all(p[:16] != prompt[:16] for p, _ in w1_requests(32000, 64))


def _run(name: str, tok_per_s: float) -> dict:
    return {"name": name, "tokens": 100, "seconds": 1.0, "tok_per_s": tok_per_s}


def test_report_gives_median_and_range_over_repeats() -> None:
    repeats = [
        [_run("kvmesh", 300.0), _run("vllm", 150.0)],
        [_run("kvmesh", 240.0), _run("vllm", 160.0)],
        [_run("kvmesh", 330.0), _run("vllm", 150.0)],
    ]
    report = _report("W1", repeats)
    key = "tok_per_s kvmesh / vllm"
    assert report["ratios"][key] == 2.0
    assert report["ratio_range"][key] == [1.5, 2.2]
    assert len(report["repeats"]) == 3
    assert report["machine"]["isa"] and report["machine"]["cpu"]  # what it ran on
    single = _report("W1", repeats[:1])
    assert single["ratios"][key] == 2.0 and "ratio_range" not in single


def test_w3_report_compares_cached_ttft_with_vllms() -> None:
    def run(name: str, ttft_mean: float) -> dict:
        return {**_run(name, 100.0), "ttft_mean": ttft_mean}

    results = [
        run("prefix-cache-on", 0.03),
        run("prefix-cache-off", 0.15),
        run("vllm-prefix-cache-on", 0.12),
        run("vllm-prefix-cache-off", 0.30),
    ]
    ratios = _report("W3", [results])["ratios"]
    assert ratios["ttft_mean on / off"] == 0.2
    assert ratios["ttft_mean prefix-cache-on / vllm-prefix-cache-on"] == 0.25
    assert ratios["ttft_mean prefix-cache-off / vllm-prefix-cache-off"] == 0.5


def test_transformers_continuous_batching_runs_w1_requests_to_their_lengths(tmp_path: Path) -> None:
    """Real transformers CB on a tiny random Llama: every request ends at exactly its length
    (EOS off; `run_hf_cb` raises otherwise), prompts longer than the 64-token step budget are
    split, and the run is summarized like the other systems."""
    from kvmesh.models.tiny import build_tiny_model

    model_dir = build_tiny_model(tmp_path / "tiny", "llama", "test", seed=0)
    requests = [(prompt[:100], out_len // 16) for prompt, out_len in w1_requests(1024, 6)]
    result = bench_throughput.run_hf_cb(str(model_dir), requests, "float32", 64)
    assert result["name"] == "transformers-cb"
    assert result["executor"] == "transformers-continuous-batching"
    assert result["dtype"] == "float32"
    assert result["tokens"] == sum(n for _, n in requests) > 0
    assert result["ttft_mean"] is not None and result["ttft_mean"] > 0


def test_transformers_continuous_batching_is_greedy_like_generate(tmp_path: Path) -> None:
    """The CB system's tokens are `generate`'s greedy tokens, request by request (chunked
    prompts under a 64-token step budget; the third prompt holds the pad id)."""
    from transformers import AutoModelForCausalLM

    from kvmesh.models.tiny import build_tiny_model

    model_dir = build_tiny_model(tmp_path / "tiny", "llama", "test", seed=0)
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, attn_implementation="sdpa", dtype="float32"
    )
    requests = [(prompt[:100], out_len // 32) for prompt, out_len in w1_requests(1024, 4)]
    expected = [_greedy(model, prompt, out_len) for prompt, out_len in requests]
    with hf_cb_manager(model, requests, 64) as manager:
        outputs = hf_cb_generate(manager, requests, "t")
    assert [o.generated_tokens for o in outputs] == expected


def _greedy(model: Any, prompt: list[int], out_len: int) -> list[int]:
    """`generate`'s greedy continuation, with an explicit all-ones mask (without one, prompt ids
    equal to the pad id would be masked out)."""
    import torch

    ids = torch.tensor([prompt])
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=out_len,
        min_new_tokens=out_len,
        do_sample=False,
    )
    return list(out[0, len(prompt) :].tolist())


def test_compare_cpu_gemm_runs_both_gemms_and_names_them(capsys: Any) -> None:
    """`--compare-cpu-gemm` adds a run on torch's GEMM; each run's JSON names the GEMM that
    ran (kvmesh's where this CPU runs it and has no AMX)."""
    import json

    import torch
    from kvmesh_kernels import cpu_gemm

    from kvmesh.cli.main import main

    argv = ["bench", "throughput", "--num-requests", "4", "--compare-cpu-gemm", "--json"]
    assert main(argv) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    linears = {run["name"]: run["linears"] for run in report["runs"]}
    runs_ours = cpu_gemm.gemm_supported(torch.float32)  # AMX has no float32 tiles
    ours = "kvmesh" if runs_ours else linears["kvmesh-torch-gemm"]
    assert linears["kvmesh"] == ours
    assert linears["kvmesh-torch-gemm"] in ("onednn", "plain")
    assert "tok_per_s kvmesh / kvmesh-torch-gemm" in report["ratios"]


def test_vllm_script_sets_threads_and_kv_budget_over_the_environment(monkeypatch: Any) -> None:
    """vLLM's CPU worker takes its threads from OMP_NUM_THREADS (it disables
    `torch.set_num_threads`) and its KV budget from VLLM_CPU_KVCACHE_SPACE: an inherited value
    must not win over `--threads` / `--kv-cache-gib`, or vLLM runs on another footing."""
    import os

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "8")
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "auto")
    os.environ.update(_load_vllm_script().vllm_env(2, 1))
    assert os.environ["OMP_NUM_THREADS"] == "2"
    assert os.environ["VLLM_CPU_KVCACHE_SPACE"] == "1"
    assert os.environ["VLLM_CPU_OMP_THREADS_BIND"] == "nobind"


def test_w3_ttft_is_timed_around_add_request_and_step_as_vllms() -> None:
    """W3's TTFT runs from before `add_request` to the return of the step that gave the first
    token (as bench/vllm_bench.py times vLLM), not the engine's own `metrics.ttft`."""
    import time
    from types import SimpleNamespace

    class SlowEngine:
        def __init__(self) -> None:
            self.pending: list[str] = []

        def add_request(self, request_id: str, prompt: list[int], params: Any) -> None:
            time.sleep(0.01)  # input processing the engine's own arrival stamp leaves out
            self.pending.append(request_id)

        def step(self) -> list[Any]:
            time.sleep(0.01)
            done, self.pending = self.pending, []
            completion = SimpleNamespace(token_ids=[7])
            metrics = SimpleNamespace(ttft=0.001)
            return [
                SimpleNamespace(request_id=r, finished=True, outputs=[completion], metrics=metrics)
                for r in done
            ]

        def has_unfinished(self) -> bool:
            return bool(self.pending)

    tokens, _, ttfts = bench_throughput.run_one_by_one(SlowEngine(), [([1, 2], 1)] * 3)
    assert tokens == 3 and len(ttfts) == 3
    assert min(ttfts) >= 0.02


def test_compare_decode_program_runs_both_decode_paths_and_names_them(capsys: Any) -> None:
    """`--compare-decode-program` adds a run whose CPU decode steps are made call by call;
    each run's JSON says which path ran, and both generate the same tokens."""
    import json

    from kvmesh.cli.main import main

    argv = ["bench", "throughput", "--num-requests", "4", "--compare-decode-program", "--json"]
    assert main(argv) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    runs = {run["name"]: run for run in report["runs"]}
    assert runs["kvmesh"]["decode_program"] is True
    assert runs["kvmesh-eager-decode"]["decode_program"] is False
    assert runs["kvmesh"]["tokens"] == runs["kvmesh-eager-decode"]["tokens"]
    assert "tok_per_s kvmesh / kvmesh-eager-decode" in report["ratios"]


def test_compare_decode_program_on_w3_adds_eager_runs_and_their_ttft_ratio(capsys: Any) -> None:
    """On W3 `--compare-decode-program` adds both caching runs with every step made call by
    call, and the TTFT ratio of those runs beside the program's."""
    import json

    from kvmesh.cli.main import main

    argv = ["bench", "throughput", "--workload", "W3", "--num-requests", "3"]
    assert main([*argv, "--compare-decode-program", "--json"]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    runs = {run["name"]: run for run in report["runs"]}
    assert [runs[f"prefix-cache-{c}-eager"]["decode_program"] for c in ("on", "off")] == [
        False,
        False,
    ]
    assert runs["prefix-cache-on"]["decode_program"] is True
    assert runs["prefix-cache-on-eager"]["tokens"] == runs["prefix-cache-on"]["tokens"]
    eager = runs["prefix-cache-on-eager"]["ttft_mean"] / runs["prefix-cache-off-eager"]["ttft_mean"]
    assert report["ratios"]["ttft_mean on / off, eager steps"] == round(eager, 3)
