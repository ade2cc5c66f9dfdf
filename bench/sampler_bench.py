"""The sampler's cost per step: `Sampler` on one batch of logits, per sampling setting.

Logits [rows, vocab] (SmolLM2-135M's 49,152 tokens by default) drawn as normal values times 4 (a
peaked distribution, as a language model's: top_p 0.9 keeps tens to hundreds of tokens), in
bfloat16 or float32, for greedy rows, temperature 1, temperature 0.7 with top_p 0.9, top_k 50
(alone and with top_p 0.9), seeded rows, penalties (each row with a 300-token prompt and 200
output tokens), logprobs and a logit_bias on 300 tokens; best of 5 calls after one untimed,
milliseconds per call.

Run: `.venv/bin/python bench/sampler_bench.py [--dtype bfloat16|float32] [--vocab N]
[--threads 2]`
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
from kvmesh_kernels.cpu_build import machine

from kvmesh.engine.sampler import Sampler, SamplingBatch, SamplingRow
from kvmesh.engine.sampling_params import SamplingParams

SETTINGS = {
    "greedy": SamplingParams(temperature=0.0),
    "temperature 1": SamplingParams(temperature=1.0),
    "temperature 0.7, top_p 0.9": SamplingParams(temperature=0.7, top_p=0.9),
    "top_k 50": SamplingParams(temperature=1.0, top_k=50),
    "top_k 50, top_p 0.9": SamplingParams(temperature=1.0, top_k=50, top_p=0.9),
    "seeded, temperature 1": SamplingParams(temperature=1.0, seed=3),
    "temperature 0.7, top_p 0.9, frequency and presence penalties 0.5": SamplingParams(
        temperature=0.7, top_p=0.9, frequency_penalty=0.5, presence_penalty=0.5
    ),
    "temperature 0.7, logprobs 5": SamplingParams(temperature=0.7, logprobs=5),
    "temperature 0.7, logit_bias on 300 tokens": SamplingParams(
        temperature=0.7, logit_bias={i * 97: 1.0 for i in range(300)}
    ),
}
PROMPT, OUTPUT = tuple(range(1000, 1300)), tuple(range(2000, 2200))  # what penalties look at


def best_ms(call: Callable[[], object], repeat: int = 5) -> float:
    call()
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        call()
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    host = machine()
    print(f"{host['cpu']} ({host['isa']}), {args.threads} threads")
    generator = torch.Generator().manual_seed(0)
    for rows in (16, 64, 256):
        logits = (torch.randn(rows, args.vocab, generator=generator) * 4).to(
            getattr(torch, args.dtype)
        )  # [rows, vocab]
        for name, params in SETTINGS.items():
            batch = SamplingBatch.build(
                [SamplingRow(params=params, prompt_ids=PROMPT, output_ids=OUTPUT)] * rows
            )
            sampler = Sampler(torch.Generator().manual_seed(1))
            ms = best_ms(lambda s=sampler, b=batch, x=logits: s(x, b))
            print(f"[{rows}, {args.vocab}] {args.dtype} {name}: {ms:.2f} ms")


if __name__ == "__main__":
    main()
