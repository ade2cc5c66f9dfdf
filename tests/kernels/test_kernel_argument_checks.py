"""The CPU kernels' wrappers refuse arguments the C code would misread (`cpu_fused`'s dtype,
stride and device asserts; the attention entry point's code 3 for a sequence longer than its
block-table row), and take every layout they document (a lone row of any row stride).

Calls that corrupted memory before these checks run in a child process, so that a regression
fails its test instead of crashing the test session.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

import kvmesh_kernels
import pytest
import torch
from dense_reference import random_paged_cache
from kvmesh_kernels import cpu_attention
from kvmesh_kernels.cpu_build import available
from kvmesh_kernels.cpu_fused import add_rms_norm, rms_norm, rope_, silu_mul

pytestmark = pytest.mark.skipif(not available(), reason="fused CPU library not built")

DTYPES = (torch.float32, torch.bfloat16)


def run_child(code: str) -> str:
    """Run `code` in a fresh interpreter; returns its stdout (fails on a crash or error)."""
    package_root = str(Path(kvmesh_kernels.__file__).resolve().parent.parent)
    path = os.pathsep.join(filter(None, (package_root, os.environ.get("PYTHONPATH"))))
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, "PYTHONPATH": path},
    )
    assert out.returncode == 0, f"child exited with {out.returncode}: {out.stderr[-2000:]}"
    return out.stdout


def hf_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """LlamaRMSNorm.forward, verbatim."""
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def close(expected: torch.Tensor, got: torch.Tensor) -> bool:
    e, g = expected.float(), got.float()
    step = 2.0**-7 if expected.dtype == torch.bfloat16 else 2.0**-20
    return bool(((e - g).abs() <= e.abs() * step + 1e-6).all())


# --- cpu_fused: one dtype, unit last stride, CPU ---------------------------------------------


def test_add_rms_norm_refuses_a_residual_of_another_dtype() -> None:
    """float32 x with a bfloat16 residual: the kernel would read and write the residual as
    float32 (twice its bytes), corrupting the heap."""
    stdout = run_child(
        """
        import torch
        from kvmesh_kernels.cpu_fused import add_rms_norm
        residual = torch.randn(4, 64).bfloat16()
        before = residual.clone()
        try:
            add_rms_norm(torch.randn(4, 64), residual, torch.randn(64).bfloat16(), 1e-6)
            print("accepted")
        except AssertionError:
            print("refused", torch.equal(residual, before))
        """
    )
    assert stdout.split() == ["refused", "True"], stdout


def _rope_strided() -> None:
    x = torch.randn(2, 3, 16)[:, :, ::2]  # [2, 3, 8], last stride 2
    rope_(x, torch.randn(16, 8), torch.randn(16, 8), torch.tensor([3, 5]))


MISREAD_CALLS: dict[str, Callable[[], object]] = {
    "rms_norm_weight_dtype": lambda: rms_norm(torch.randn(4, 64).bfloat16(), torch.randn(64), 1e-6),
    "rms_norm_strided_columns": lambda: rms_norm(
        torch.randn(4, 128)[:, ::2], torch.randn(64), 1e-6
    ),
    "add_rms_norm_weight_dtype": lambda: add_rms_norm(
        torch.randn(4, 64).bfloat16(), torch.randn(4, 64).bfloat16(), torch.randn(64), 1e-6
    ),
    "add_rms_norm_strided_columns": lambda: add_rms_norm(
        torch.randn(4, 128)[:, ::2], torch.randn(4, 64), torch.randn(64), 1e-6
    ),
    "silu_mul_strided_columns": lambda: silu_mul(torch.randn(3, 128)[:, ::2]),
    "rope_strided_last_dim": _rope_strided,
}


@pytest.mark.parametrize("case", MISREAD_CALLS)
def test_fused_ops_refuse_what_the_kernel_would_misread(case: str) -> None:
    """Mixed dtypes or a non-unit last stride: an AssertionError, not a silently wrong result
    (every tensor here is large enough that the unchecked kernel read stays in bounds)."""
    with pytest.raises(AssertionError):
        MISREAD_CALLS[case]()


# --- cpu_fused: a lone row's row stride is arbitrary ------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_of_a_lone_transposed_row(dtype: torch.dtype) -> None:
    """[1, n] from a transpose has row stride 1 < n (torch calls it contiguous)."""
    x = torch.randn(64, 1).to(dtype).t()  # [1, 64], strides (1, 1)
    assert x.stride(0) < x.shape[1]
    weight = torch.randn(64).to(dtype)
    assert close(hf_norm(x, weight, 1e-6), rms_norm(x, weight, 1e-6))


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm_of_a_lone_transposed_row(dtype: torch.dtype) -> None:
    x = torch.randn(64, 1).to(dtype).t()  # [1, 64], strides (1, 1)
    residual = torch.randn(1, 64).to(dtype)
    weight = torch.randn(64).to(dtype)
    total = x + residual
    got = add_rms_norm(x, residual, weight, 1e-6)
    assert torch.equal(residual, total)
    assert close(hf_norm(total, weight, 1e-6), got)


# --- paged attention: a context must fit its block-table row ---------------------------------


def test_attention_at_full_table_capacity_still_runs() -> None:
    """seq_len == max_blocks * block_size is the largest valid context: it computes."""
    pc = random_paged_cache([32], num_kv_heads=1, head_dim=64, block_size=16)
    tables = pc.block_tables[:, :2]  # capacity 32 tokens
    q = torch.randn(1, 2, 64)
    out = cpu_attention.cpu_paged_decode_attention(
        q, pc.cache.layer(0), tables, pc.seq_lens, scale=0.1
    )
    assert out.shape == (1, 2, 64) and bool(torch.isfinite(out).all())


@pytest.mark.parametrize(
    ("lens", "starts"),
    [
        ([33, 16], [0, 1, 2]),  # one token past its row (the next row's first block read)
        ([-1, 16], [0, 1, 2]),  # a negative context
        ([8, 16], [0, 2, 1]),  # a negative query chunk
    ],
)
def test_attention_refuses_lengths_outside_the_table(lens: list[int], starts: list[int]) -> None:
    """Code 3, in place of reading another sequence's block or computing nonsense. Every read
    the unchecked kernel makes here stays inside the tensors (a two-row table)."""
    pc = random_paged_cache([16, 16], num_kv_heads=1, head_dim=64, block_size=16)
    tables = pc.block_tables[:, :2].contiguous()  # [2, 2]: capacity 32 tokens per row
    q = torch.randn(2, 2, 64)
    with pytest.raises(RuntimeError, match=r"code 3\b"):
        cpu_attention.cpu_paged_attention(
            q,
            pc.cache.layer(0),
            tables,
            torch.tensor(lens, dtype=torch.int32),
            torch.tensor(starts, dtype=torch.int32),
            scale=0.1,
        )


def test_attention_refuses_a_context_far_past_its_table() -> None:
    """seq_len 2**28 against a one-block row: the unchecked kernel walked 2**24 table entries
    past the row (a crash); now code 3 before any work."""
    stdout = run_child(
        """
        import torch
        from kvmesh_kernels import KVCacheSpec, allocate_kv_cache, cpu_attention
        spec = KVCacheSpec(num_blocks=4, num_layers=1, block_size=16, num_kv_heads=1, head_dim=64)
        cache = allocate_kv_cache(spec)
        tables = torch.zeros(1, 1, dtype=torch.int32)
        lens = torch.tensor([1 << 28], dtype=torch.int32)
        try:
            cpu_attention.cpu_paged_decode_attention(
                torch.randn(1, 1, 64), cache.layer(0), tables, lens, scale=0.1
            )
            print("accepted")
        except RuntimeError as exc:
            print("refused:", exc)
        """
    )
    assert stdout.startswith("refused:") and "code 3" in stdout, stdout
