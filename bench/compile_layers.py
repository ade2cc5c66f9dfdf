"""One native decoder layer's math, eager (fused kernels) against `compile="on"` (inductor).

    python bench/compile_layers.py [--model PATH] [--dtype float32] [--threads 2]

Loads the model with the native executor, times `pre_attention` + `post_attention` of one
layer (the per-layer math around attention) at decode and prompt token counts, then compiles
the same model in place (`kvmesh.engine.native.compiled`) and times the compiled regions
after their first calls (compile seconds reported separately). Best of 5 rounds.
"""

from __future__ import annotations

import argparse
import json
import time
import timeit

import torch

from kvmesh.engine.config import EngineConfig
from kvmesh.engine.loader import load_model
from kvmesh.engine.native.compiled import compile_native
from kvmesh.models.tiny import tiny_model_path

TOKENS = (1, 16, 64, 256)


def layer_us(model: torch.nn.Module, tokens: int) -> float:
    """Microseconds of one layer's two regions for `tokens` tokens (best of 5 x 10 calls)."""
    layer = model.layers[1]
    hidden = model.embed.weight.shape[1]
    x, residual = torch.randn(tokens, hidden), torch.randn(tokens, hidden)
    rotary = model.rotary.at(torch.arange(tokens))

    def run() -> None:
        q, _, _, res = layer.pre_attention(x, residual.clone(), rotary)
        layer.post_attention(q, res)

    with torch.inference_mode():
        run()
        return min(timeit.repeat(run, number=10, repeat=5)) / 10 * 1e6


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="checkpoint (default: the bench model)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model_path = args.model or str(tiny_model_path("bench"))
    config = EngineConfig(model=model_path, dtype=args.dtype, executor="native")
    model = load_model(config).model
    eager = {n: layer_us(model, n) for n in TOKENS}
    compile_native(model)
    started = time.monotonic()
    compiled = {n: layer_us(model, n) for n in TOKENS}
    seconds = time.monotonic() - started
    rows = [
        {"tokens": n, "eager_us": round(eager[n], 1), "compiled_us": round(compiled[n], 1),
         "eager_over_compiled": round(eager[n] / compiled[n], 3)}
        for n in TOKENS
    ]  # fmt: skip
    print(json.dumps({"model": model_path, "dtype": args.dtype, "rows": rows,
                      "compile_and_timing_s": round(seconds, 1)}))  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
