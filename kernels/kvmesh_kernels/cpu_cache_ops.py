"""KV write on CPU through the C library (`csrc/cpu_cache_ops.cpp`): K and V in one call.

For unquantized caches (float32, bfloat16, float16) whose key/value come in the cache's own
dtype the write is a bitwise copy of each token's `[Hkv, D]` rows to its slot. For int8 and
fp8 caches, key/value in float32, bfloat16 or float16 are quantized row by row in C (per
(token, kv head) scale, `kvmesh_kernels.quant.quantize`'s arithmetic). Both equal the torch
reference (`torch_write_kv`) bit for bit; other dtype pairs stay on the torch path
(`supports_write` says which). Arguments are validated by the caller (dispatch or
AttentionPlan); the C side re-checks the slot range before writing anything.
"""

from __future__ import annotations

import ctypes

import torch

from kvmesh_kernels.cache import LayerKV
from kvmesh_kernels.cpu_build import WRITE_ENTRY, library

_COPY_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_SOURCE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}  # quantized writes
_QUANT_CODES = {"auto": 0, "int8": 1, "fp8": 2}
# Mirror of `WriteParams` in the C++ source, in order (every field 8 bytes).
_FIELDS = (
    *("key", "value", "slots", "data"),
    *("elem_bytes", "num_tokens", "num_kv_heads", "head_dim"),
    *("s_ktok", "s_khead", "s_vtok", "s_vhead"),
    *("num_blocks", "block_size", "s_block", "s_kv", "s_tok", "s_head", "num_threads"),
    *("quant", "src_dtype", "scales", "ss_block", "ss_kv", "ss_tok", "ss_head"),
)


class _WriteParams(ctypes.Structure):
    _fields_ = [(name, ctypes.c_int64) for name in _FIELDS]


def supports_layer(layer: LayerKV) -> bool:
    """Whether the C write can store into this layer (CPU, unit head stride; unquantized
    float32 / bfloat16 / float16, or int8 / fp8 with float32 scales)."""
    data = layer.data
    if data.device.type != "cpu" or data.stride(-1) != 1 or library() is None:
        return False
    if layer.scales is None:
        return data.dtype in _COPY_DTYPES
    return layer.kv_dtype in ("int8", "fp8") and layer.scales.dtype == torch.float32


def supports_write(layer: LayerKV, key: torch.Tensor, value: torch.Tensor) -> bool:
    """Whether key/value can be written as they are (see `kv_writable`) into this layer."""
    return kv_writable(layer.data.dtype, layer.scales is not None, key, value) and (
        supports_layer(layer)
    )


def kv_writable(
    dtype: torch.dtype, quantized: bool, key: torch.Tensor, value: torch.Tensor
) -> bool:
    """Whether key/value (CPU, unit last stride, one dtype) can be written into a supported
    cache of storage `dtype`: copied when they have that dtype, quantized (`quantized`) from
    float32, bfloat16 or float16."""
    return (
        key.dtype == value.dtype
        and (key.dtype in _SOURCE_CODES if quantized else key.dtype == dtype)
        and key.device.type == "cpu"
        and value.device.type == "cpu"
        and key.stride(-1) == 1
        and value.stride(-1) == 1
    )


class WriteCall:
    """One step's slots prepared for the C write: a ctypes `WriteParams` whose slot and cache
    fields are filled once; a per-layer call sets the key, value and layer pointers.

    `layer` fixes the cache format (any layer view of the cache: they share shape and strides,
    scales' too); slot_mapping [num_tokens] integer is converted to int64 once and kept alive
    here.
    """

    def __init__(self, layer: LayerKV, slot_mapping: torch.Tensor) -> None:
        lib = library()
        assert lib is not None, "CPU kernel library unavailable (check supports_layer() first)"
        self._entry = getattr(lib, WRITE_ENTRY)
        self.slots = slot_mapping.to(torch.int64).contiguous()  # [num_tokens]
        data = layer.data  # [num_blocks, 2, block_size, Hkv, D]
        self.params = _WriteParams(
            slots=self.slots.data_ptr(),
            elem_bytes=data.element_size(),
            num_tokens=self.slots.shape[0],
            num_kv_heads=layer.num_kv_heads,
            head_dim=layer.head_dim,
            num_blocks=data.shape[0],
            block_size=layer.block_size,
            s_block=data.stride(0),
            s_kv=data.stride(1),
            s_tok=data.stride(2),
            s_head=data.stride(3),
            quant=_QUANT_CODES[layer.kv_dtype] if layer.scales is not None else 0,
        )
        if layer.scales is not None:  # [num_blocks, 2, block_size, Hkv]
            p, scales = self.params, layer.scales
            p.ss_block, p.ss_kv, p.ss_tok, p.ss_head = scales.stride()

    def __call__(
        self, key: torch.Tensor, value: torch.Tensor, data_ptr: int, scales_ptr: int = 0
    ) -> None:
        """Write key/value [num_tokens, Hkv, D] (`kv_writable`) into the layer whose data
        starts at data_ptr (its scales at scales_ptr when quantized). A slot outside [-1,
        num_blocks * block_size) raises ValueError (dispatch's message) before anything is
        written."""
        self.prepare(key, value, data_ptr, scales_ptr)
        p = self.params
        if p.num_tokens:
            rc = self._entry(ctypes.byref(p))
            if rc == 2:
                raise ValueError(f"slot_mapping must lie in [-1, {p.num_blocks * p.block_size})")
            if rc != 0:
                raise RuntimeError(f"CPU write_kv kernel rejected its arguments (code {rc})")

    def prepare(
        self, key: torch.Tensor, value: torch.Tensor, data_ptr: int, scales_ptr: int = 0
    ) -> None:
        """Fill `params` for a write of these arguments (as `__call__` documents them)
        without running it: what a recorded program (`cpu_program`) replays."""
        p = self.params
        p.key, p.value, p.data = key.data_ptr(), value.data_ptr(), data_ptr
        if p.quant:
            assert scales_ptr, "a quantized cache's write needs its scales"
            p.scales, p.src_dtype = scales_ptr, _SOURCE_CODES[key.dtype]
        p.s_ktok, p.s_khead = key.stride(0), key.stride(1)
        p.s_vtok, p.s_vhead = value.stride(0), value.stride(1)
        p.num_threads = torch.get_num_threads()


def cpu_write_kv(
    layer: LayerKV, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Store key/value [num_tokens, Hkv, D] at slot_mapping [num_tokens] (-1 skips a token);
    requires `supports_write(layer, key, value)`."""
    scales_ptr = 0 if layer.scales is None else layer.scales.data_ptr()
    WriteCall(layer, slot_mapping)(key, value, layer.data.data_ptr(), scales_ptr)
