"""Attention-output error of int8/fp8 KV quantization schemes on random data with outlier
K channels (as real models have). Prints ‖out − ref‖/‖ref‖ per scheme; informs the scale
layout chosen in kvmesh_kernels.quant (docs/KERNELS.md, "KV quantization").

    .venv/bin/python bench/kv_quant_error.py [--outlier-gain 20] [--seeds 3]
"""

from __future__ import annotations

import argparse

import torch

QMAX = {"int8": 127.0, "fp8": 448.0}


def fake_quant(x: torch.Tensor, amax: torch.Tensor, kind: str) -> torch.Tensor:
    """Quantize-dequantize x with scale amax / QMAX (amax broadcasts against x)."""
    scale = (amax / QMAX[kind]).clamp_min(1e-8)
    y = x / scale
    y = y.round().clamp(-127, 127) if kind == "int8" else y.to(torch.float8_e4m3fn).float()
    return y * scale


def per_token_groups(x: torch.Tensor, group: int, kind: str) -> torch.Tensor:
    """One scale per (token, head, group of channels). x [T, H, D]."""
    t, h, d = x.shape
    g = x.view(t, h, d // group, group)  # [T, H, D/group, group]
    return fake_quant(g, g.abs().amax(-1, keepdim=True), kind).view(t, h, d)


def per_channel_blocks(x: torch.Tensor, block: int, kind: str) -> torch.Tensor:
    """One scale per (block of tokens, head, channel), KIVI-style keys. x [T, H, D]."""
    t, h, d = x.shape
    g = x.view(t // block, block, h, d)  # [T/block, block, H, D]
    return fake_quant(g, g.abs().amax(1, keepdim=True), kind).view(t, h, d)


SCHEMES = {
    "K,V per token+head (group=D)": lambda k, v, q: (
        per_token_groups(k, k.shape[-1], q),
        per_token_groups(v, v.shape[-1], q),
    ),
    "K,V per token+head, group=32": lambda k, v, q: (
        per_token_groups(k, 32, q),
        per_token_groups(v, 32, q),
    ),
    "K per channel (block 16), V per token": lambda k, v, q: (
        per_channel_blocks(k, 16, q),
        per_token_groups(v, v.shape[-1], q),
    ),
}


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """q [Hq, D], k/v [T, Hkv, D] -> [Hq, D] in float64 (GQA by repeat)."""
    group = q.shape[0] // k.shape[1]
    k = k.double().repeat_interleave(group, 1)  # [T, Hq, D]
    v = v.double().repeat_interleave(group, 1)
    p = torch.softmax(torch.einsum("hd,thd->ht", q.double(), k) / q.shape[-1] ** 0.5, -1)
    return torch.einsum("ht,thd->hd", p, v)


def run(outliers: int, gain: float, seeds: int, ctx: int) -> list[tuple[str, str, float]]:
    rows = []
    for kind in ("int8", "fp8"):
        for name, scheme in SCHEMES.items():
            errs = []
            for seed in range(seeds):
                gen = torch.Generator().manual_seed(seed)
                k = torch.randn(ctx, 8, 128, generator=gen)  # [T, Hkv, D]
                v = torch.randn(ctx, 8, 128, generator=gen)
                chans = torch.randperm(128, generator=gen)[:outliers]
                k[..., chans] = k[..., chans] * gain + gain
                q = torch.randn(32, 128, generator=gen)  # [Hq, D]
                ref = attention(q, k, v)
                kq, vq = scheme(k, v, kind)
                errs.append(((attention(q, kq, vq) - ref).norm() / ref.norm()).item())
            rows.append((kind, name, sum(errs) / len(errs)))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--outliers", type=int, default=4, help="outlier K channels of 128")
    parser.add_argument("--outlier-gain", type=float, default=20.0)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--context", type=int, default=1024)
    args = parser.parse_args()
    for gain in (1.0, args.outlier_gain):
        print(f"outlier channels: {args.outliers}, gain {gain}, context {args.context}")
        for kind, name, err in run(args.outliers, gain, args.seeds, args.context):
            print(f"  {kind:5s} {name:40s} rel err {err:.4f}")


if __name__ == "__main__":
    main()
