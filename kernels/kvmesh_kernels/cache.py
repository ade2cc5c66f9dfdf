"""The paged KV cache: spec, allocation, per-layer views, and block packing.

Layout (one tensor per worker, block-major)::

    data:   [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]   # 2 = (K, V)
    scales: [num_blocks, num_layers, 2, block_size, num_kv_heads]  float32, quantized only
    slot = block_id * block_size + offset_in_block

One block (all layers, K and V, and its scales) is one contiguous byte range of `data`
(and of `scales`), so packing a block set is an `index_select` on dim 0.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from kvmesh_kernels.hugepages import host_zeros

KV_DTYPES = ("auto", "int8", "fp8")
HEAD_DIMS = (32, 64, 80, 96, 128, 256)
FP8_DTYPE = torch.float8_e4m3fn


def raw_view(x: torch.Tensor) -> torch.Tensor:
    """Same bytes, as uint8 when the dtype is fp8 (CPU index_copy_/index_select lack fp8)."""
    return x.view(torch.uint8) if x.dtype == FP8_DTYPE else x


@dataclass(frozen=True)
class KVCacheSpec:
    """Shape and element types of one worker's paged KV cache.

    `dtype` is the model's K/V dtype; `kv_dtype` the storage format: "auto" stores `dtype`,
    "int8" and "fp8" (e4m3) store quantized values with one float32 scale per token and head.
    """

    num_blocks: int
    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype = torch.float32
    kv_dtype: str = "auto"

    def validate(self) -> KVCacheSpec:
        """Raise ValueError naming the first bad field; return self."""
        for name in ("num_blocks", "num_layers", "block_size", "num_kv_heads", "head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"KVCacheSpec.{name} must be a positive int, got {value!r}")
        if self.dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise ValueError(
                f"KVCacheSpec.dtype must be float32/float16/bfloat16, got {self.dtype}"
            )
        if self.kv_dtype not in KV_DTYPES:
            raise ValueError(
                f"KVCacheSpec.kv_dtype must be one of {KV_DTYPES}, got {self.kv_dtype!r}"
            )
        return self

    @property
    def quantized(self) -> bool:
        return self.kv_dtype != "auto"

    @property
    def storage_dtype(self) -> torch.dtype:
        """Element type of `data`."""
        return {"auto": self.dtype, "int8": torch.int8, "fp8": FP8_DTYPE}[self.kv_dtype]

    @property
    def data_shape(self) -> tuple[int, ...]:
        return (
            self.num_blocks,
            self.num_layers,
            2,
            self.block_size,
            self.num_kv_heads,
            self.head_dim,
        )

    @property
    def scales_shape(self) -> tuple[int, ...]:
        return self.data_shape[:-1]

    @property
    def bytes_per_block(self) -> int:
        """Bytes of one block over all layers, K and V, scales included."""
        elems = self.num_layers * 2 * self.block_size * self.num_kv_heads
        per_elem = torch.empty((), dtype=self.storage_dtype).element_size()
        scale_bytes = elems * 4 if self.quantized else 0
        return elems * self.head_dim * per_elem + scale_bytes


@dataclass(frozen=True)
class LayerKV:
    """One layer of the cache: views, not copies.

    data:   [num_blocks, 2, block_size, num_kv_heads, head_dim]  storage dtype
    scales: [num_blocks, 2, block_size, num_kv_heads] float32, or None when not quantized
    """

    data: torch.Tensor
    scales: torch.Tensor | None
    kv_dtype: str
    dtype: torch.dtype

    @property
    def block_size(self) -> int:
        return int(self.data.shape[2])

    @property
    def num_kv_heads(self) -> int:
        return int(self.data.shape[3])

    @property
    def head_dim(self) -> int:
        return int(self.data.shape[4])


@dataclass(frozen=True)
class PagedKVCache:
    """The whole cache of one worker (see the module docstring for the layout)."""

    spec: KVCacheSpec
    data: torch.Tensor  # [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]
    scales: torch.Tensor | None  # [num_blocks, num_layers, 2, block_size, num_kv_heads]

    def layer(self, index: int) -> LayerKV:
        if not 0 <= index < self.spec.num_layers:
            raise IndexError(f"layer index {index} out of range [0, {self.spec.num_layers})")
        scales = None if self.scales is None else self.scales[:, index]
        return LayerKV(self.data[:, index], scales, self.spec.kv_dtype, self.spec.dtype)


def allocate_kv_cache(
    spec: KVCacheSpec, device: torch.device | str = "cpu", huge_pages: bool = True
) -> PagedKVCache:
    """Allocate a zeroed cache (scales start at 1.0 so unwritten slots dequantize to 0). On
    the host the data is advised for transparent huge pages before it is first touched
    (`kvmesh_kernels.hugepages`: float32 decode attention in 0.83-0.88x the time), or against
    them with `huge_pages=False` (the side-by-side baseline)."""
    spec.validate()
    if torch.device(device).type == "cpu":
        data = host_zeros(tuple(spec.data_shape), spec.storage_dtype, huge_pages)
    else:
        data = torch.zeros(spec.data_shape, dtype=spec.storage_dtype, device=device)
    scales = None
    if spec.quantized:
        scales = torch.ones(spec.scales_shape, dtype=torch.float32, device=device)
    return PagedKVCache(spec, data, scales)


@dataclass(frozen=True)
class PackedBlocks:
    """Whole blocks copied out of a cache, contiguous, in the order asked for.

    data:   [N, num_layers, 2, block_size, num_kv_heads, head_dim]  storage dtype
    scales: [N, num_layers, 2, block_size, num_kv_heads] float32, or None
    """

    spec: KVCacheSpec
    data: torch.Tensor
    scales: torch.Tensor | None


def _block_ids(cache: PagedKVCache, block_ids: Any, name: str = "block_ids") -> torch.Tensor:
    ids = torch.as_tensor(block_ids, dtype=torch.int64, device=cache.data.device).reshape(-1)
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= cache.spec.num_blocks):
        raise ValueError(f"{name} must lie in [0, {cache.spec.num_blocks})")
    return ids  # [N]


def _runs(ids: torch.Tensor) -> list[tuple[int, int, int]]:
    """(first id, position in `ids`, length) of each run of consecutive ids."""
    values = ids.tolist()
    runs, start = [], 0
    for end in range(1, len(values) + 1):
        if end == len(values) or values[end] != values[end - 1] + 1:
            runs.append((values[start], start, end - start))
            start = end
    return runs


def _select_rows(src: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """src[ids] along dim 0. On CPU one copy per run of consecutive ids: for block-sized rows
    `index_select` / `index_copy_` run at a fraction of memcpy speed there."""
    if src.device.type != "cpu":
        return src.index_select(0, ids)
    out = torch.empty((int(ids.numel()), *src.shape[1:]), dtype=src.dtype)
    for first, at, length in _runs(ids):
        out[at : at + length].copy_(src[first : first + length])
    return out


def _put_rows(dst: torch.Tensor, ids: torch.Tensor, src: torch.Tensor) -> None:
    """dst[ids] = src along dim 0 (per run of consecutive ids on CPU, as `_select_rows`)."""
    if dst.device.type != "cpu":
        dst.index_copy_(0, ids, src.to(dst.device))
        return
    for first, at, length in _runs(ids):
        dst[first : first + length].copy_(src[at : at + length])


def gather_blocks(cache: PagedKVCache, block_ids: Any) -> PackedBlocks:
    """Copy the given blocks (all layers, scales too) into one contiguous PackedBlocks."""
    ids = _block_ids(cache, block_ids)
    data = _select_rows(raw_view(cache.data), ids).view(cache.data.dtype)
    scales = None if cache.scales is None else _select_rows(cache.scales, ids)
    return PackedBlocks(cache.spec, data, scales)


def scatter_blocks(cache: PagedKVCache, block_ids: Any, packed: PackedBlocks) -> None:
    """Write packed blocks back into `cache` at `block_ids` (inverse of gather_blocks)."""
    ids = _block_ids(cache, block_ids)
    expected = (int(ids.numel()), *cache.spec.data_shape[1:])
    if tuple(packed.data.shape) != expected or packed.data.dtype != cache.data.dtype:
        raise ValueError(
            f"packed.data must be {expected} {cache.data.dtype}, "
            f"got {tuple(packed.data.shape)} {packed.data.dtype}"
        )
    if (packed.scales is None) != (cache.scales is None):
        raise ValueError("packed.scales must be present exactly when the cache is quantized")
    _put_rows(raw_view(cache.data), ids, raw_view(packed.data))
    if cache.scales is not None and packed.scales is not None:
        _put_rows(cache.scales, ids, packed.scales)


_DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}


def spec_to_dict(spec: KVCacheSpec) -> dict[str, Any]:
    """Plain ints and strings, safe for JSON or protobuf (no pickle)."""
    return {
        "num_blocks": spec.num_blocks,
        "num_layers": spec.num_layers,
        "block_size": spec.block_size,
        "num_kv_heads": spec.num_kv_heads,
        "head_dim": spec.head_dim,
        "dtype": _DTYPE_NAMES[spec.dtype],
        "kv_dtype": spec.kv_dtype,
    }


def spec_from_dict(fields: dict[str, Any]) -> KVCacheSpec:
    """Inverse of spec_to_dict; raises ValueError naming a bad field."""
    names = {v: k for k, v in _DTYPE_NAMES.items()}
    if fields.get("dtype") not in names:
        raise ValueError(f"spec field 'dtype' must be one of {sorted(names)}")
    values = {k: fields[k] for k in spec_to_dict(KVCacheSpec(1, 1, 1, 1, 1)) if k != "dtype"}
    return KVCacheSpec(**values, dtype=names[fields["dtype"]]).validate()


@dataclass(frozen=True)
class PackedBytes:
    """PackedBlocks as raw bytes plus what is needed to read them back.

    spec: the source cache's spec (layout and dtypes); num_blocks: blocks packed (N)
    data: [N * elements_per_block * element_size] uint8; scales: [N * ... * 4] uint8 or None
    """

    spec: KVCacheSpec
    num_blocks: int
    data: torch.Tensor
    scales: torch.Tensor | None


def packed_to_bytes(packed: PackedBlocks) -> PackedBytes:
    """uint8 views of a PackedBlocks (no copy when already contiguous)."""
    data = packed.data.contiguous().reshape(-1).view(torch.uint8)
    scales = None
    if packed.scales is not None:
        scales = packed.scales.contiguous().reshape(-1).view(torch.uint8)
    return PackedBytes(packed.spec, int(packed.data.shape[0]), data, scales)


def packed_from_bytes(raw: PackedBytes) -> PackedBlocks:
    """Reinterpret bytes as PackedBlocks (views, no copy); checks dtypes and byte counts."""
    spec = raw.spec.validate()
    shape = (raw.num_blocks, *spec.data_shape[1:])
    if raw.data.dtype != torch.uint8 or raw.data.dim() != 1:
        raise ValueError("raw.data must be a 1-D uint8 tensor")
    data = raw.data.view(spec.storage_dtype)
    if data.numel() != torch.Size(shape).numel():
        raise ValueError(f"raw.data holds {data.numel()} elements, expected {shape}")
    scales = None
    if spec.quantized:
        if raw.scales is None or raw.scales.dtype != torch.uint8:
            raise ValueError("raw.scales must be a uint8 tensor for a quantized spec")
        scales = raw.scales.view(torch.float32).reshape(raw.num_blocks, *spec.scales_shape[1:])
    return PackedBlocks(spec, data.reshape(shape), scales)
