"""Linear layers with oneDNN-prepacked weights, for bfloat16/float16 models on CPU.

`F.linear` on a bfloat16 CPU weight hands oneDNN a plain [out, in] matrix, which it re-lays out
into its blocked AMX/AVX-512 format on every call. A decode step's matmuls are small (one row
per running sequence), so that re-layout is a large share of each call: packing the weight once
at load runs the same matmuls 1.03-1.89x faster, bit-identical (`bench/micro_choices.py`,
docs/BENCHMARKS.md "Implementation choices"). In float32 the gain depends on the machine
(none measured on one Intel host, 1.3-2.2x on an AMD AVX-512 host, where MKL's sgemm is slow),
so transformers' modules keep MKL's sgemm and the native executor measures both at load
(`float32_packing_wins`).

Only the module class changes: transformers' model code still calls `self.q_proj(x)` and so
on. The plain weight is dropped after packing (a tied `lm_head` keeps the embedding's copy).
Inside `torch.compile` regions the packed GEMM is the custom op `kvmesh::packed_linear` (the
opaque packed weight cannot be traced; the op finds it by a handle tensor).

On x86-64 CPUs with AVX2 + FMA or AVX-512 (float32) or AVX512_BF16 (bfloat16) the native
executor's linears run kvmesh's own GEMM instead (`CpuGemmLinear`, `kvmesh_kernels.cpu_gemm`):
the same arithmetic, 1.1-1.4x faster than oneDNN's at a decode step's row counts and level on
prompt steps (docs/BENCHMARKS.md "kvmesh's CPU GEMM").
"""

from __future__ import annotations

import itertools
import logging
import time
import weakref
from collections.abc import Callable

import torch
from kvmesh_kernels import cpu_gemm
from torch import nn

logger = logging.getLogger(__name__)

PACKED_DTYPES = (torch.bfloat16, torch.float16)
_LIVE: weakref.WeakValueDictionary[int, PackedLinear] = weakref.WeakValueDictionary()
_HANDLES = itertools.count()


class PackedLinear(nn.Module):
    """`nn.Linear` with its weight in oneDNN's packed layout: x [..., in] -> [..., out]."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self._pack(linear.weight, linear.bias)

    @classmethod
    def from_weight(cls, weight: torch.Tensor, bias: torch.Tensor | None) -> PackedLinear:
        """Pack weight [out, in] (and bias [out]) directly, without an nn.Linear."""
        module = cls.__new__(cls)
        nn.Module.__init__(module)
        module.out_features, module.in_features = (int(n) for n in weight.shape)
        module._pack(weight, bias)
        return module

    def _pack(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        plain = weight.detach()  # [out, in]
        self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(plain, None)  # opaque
        self.bias = None if bias is None else bias.detach().contiguous()  # [out]
        self._register()

    def _register(self) -> None:
        """Make this module the compiled op's target under a fresh handle."""
        handle = next(_HANDLES)
        _LIVE[handle] = self
        self.handle = torch.tensor(handle, dtype=torch.int64)  # [] the compiled op's key

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            return packed_linear(x, self.handle, self.bias, self.out_features)
        return self.run(x)

    def run(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(  # type: ignore[no-any-return]
            x, self.packed_weight, self.bias, "none", [], ""
        )

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, packed=oneDNN"


class CpuGemmLinear(PackedLinear):
    """A bfloat16 or float32 linear on kvmesh's CPU GEMM (`kvmesh_kernels.cpu_gemm`): the
    weight packed once into the kernel's panels, the bias kept in float32 (padded to whole
    panels). Faster than oneDNN's and MKL's GEMMs at decode sizes, level on prompt-sized steps
    (docs/BENCHMARKS.md "kvmesh's CPU GEMM"). A bfloat16 weight needs an even in_features
    (`cpu_gemm.weight_fits`)."""

    def _pack(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.packed_weight = cpu_gemm.pack_weight(weight.detach().contiguous())
        packed = self.packed_weight
        self.bias = None if bias is None else cpu_gemm.pack_bias(bias, packed)  # [padded out]
        self._register()

    def run(self, x: torch.Tensor) -> torch.Tensor:
        return cpu_gemm.linear(x, self.packed_weight, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, packed=kvmesh"


class CpuGemmGateUpSilu(CpuGemmLinear):
    """The MLP's merged gate|up linear with SiLU-and-mul in kvmesh's GEMM epilogue: x [..., in]
    -> silu(x . gate^T) * (x . up^T) [..., I] (`cpu_gemm.gate_up_silu`), bit for bit the
    plain linear followed by `cpu_fused.silu_mul`, without writing and reading back the
    [..., 2 * I] product. `out_features` is I; no bias (`cpu_gemm.gate_up_fits` says which
    weights it takes)."""

    activates = True  # its output is the MLP's activation, not gate|up

    def _pack(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        assert bias is None, "the fused gate|up linear takes no bias"
        self.packed_weight = cpu_gemm.pack_gate_up(weight.detach().contiguous())
        self.out_features = self.packed_weight.out_features // 2
        self.bias = None
        self._register()

    def run(self, x: torch.Tensor) -> torch.Tensor:
        return cpu_gemm.gate_up_silu(x, self.packed_weight)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            "packed=kvmesh, epilogue=silu_mul"
        )


@torch.library.custom_op("kvmesh::packed_linear", mutates_args=())
def packed_linear(
    x: torch.Tensor, handle: torch.Tensor, bias: torch.Tensor | None, out_features: int
) -> torch.Tensor:
    """x [..., in] through the live PackedLinear named by `handle` -> [..., out_features]."""
    return _LIVE[int(handle)].run(x)


@packed_linear.register_fake
def _packed_linear_shape(
    x: torch.Tensor, handle: torch.Tensor, bias: torch.Tensor | None, out_features: int
) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], out_features))


def kvmesh_gemm_applies(dtype: torch.dtype, device: torch.device) -> bool:
    """True on a CPU that runs kvmesh's GEMM of `dtype` (float32: AVX2 + FMA or AVX-512;
    bfloat16: AVX-512 with AVX512_BF16; library built)."""
    return device.type == "cpu" and cpu_gemm.gemm_supported(dtype)


def packing_applies(dtype: torch.dtype, device: torch.device) -> bool:
    """True on CPU for bfloat16/float16 when oneDNN runs that dtype natively on this CPU."""
    if (
        device.type != "cpu"
        or dtype not in PACKED_DTYPES
        or not torch.backends.mkldnn.is_available()
    ):
        return False
    if dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())


def float32_packing_wins(in_features: int, out_features: int, rows: int = 64) -> bool:
    """Whether oneDNN's packed float32 linear beats `F.linear` (MKL) by 10% on this CPU for a
    decode-sized GEMM [rows, in] x [out, in]^T (a few milliseconds, measured once at load).
    Machines differ: MKL's float32 GEMM ran 1.3-2.2x slower than the packed one on an AMD
    AVX-512 host and no faster elsewhere (docs/BENCHMARKS.md)."""
    if not torch.backends.mkldnn.is_available():
        return False
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(out_features, in_features, generator=generator)  # [out, in]
    x = torch.randn(rows, in_features, generator=generator)  # [rows, in]
    packed = PackedLinear.from_weight(weight, None)
    with torch.inference_mode():
        plain_seconds = best_of(lambda: torch.nn.functional.linear(x, weight))
        packed_seconds = best_of(lambda: packed(x))
    return packed_seconds * 1.1 < plain_seconds


def best_of(run: Callable[[], object], rounds: int = 5, calls: int = 4) -> float:
    """Wall seconds of the fastest of `rounds` rounds of `calls` calls (load-time choices)."""
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            run()
        best = min(best, time.perf_counter() - start)
    return best


def pack_linear_layers(model: nn.Module) -> int:
    """Replace every `nn.Linear` under `model` by a PackedLinear; returns how many."""
    targets = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if type(child) is nn.Linear
    ]
    for parent, name, child in targets:
        setattr(parent, name, PackedLinear(child))
    logger.info("packed %d linear layers for oneDNN", len(targets))
    return len(targets)
