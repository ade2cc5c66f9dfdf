"""`KVLayout`: what both sides must agree on before any KV bytes move (checked at handshake)."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from kv_transfer.errors import FrameError, LayoutMismatchError

LAYOUT_NAME = "block-major-v1"
ITEMSIZE = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "int8": 1,
    "uint8": 1,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
}


@dataclasses.dataclass(frozen=True)
class KVLayout:
    """One block is `cache[block_id]` of the block-major cache
    `[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]`; quantized caches add
    `scales[block_id]` of `[num_blocks, num_layers, 2, block_size, num_kv_heads]` float32."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: str  # element type of the cache tensor, torch name without "torch."
    kv_dtype: str = "auto"  # "auto" | "int8" | "fp8"
    layout: str = LAYOUT_NAME
    model_id: str = ""  # model identity (name or content hash); "" matches only ""
    scales_bytes_per_block: int = 0  # 0 when the cache carries no scales tensor

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise FrameError(name, f"must be a positive int, got {value!r}")
        if self.dtype not in ITEMSIZE:
            raise FrameError("dtype", f"unsupported dtype {self.dtype!r}")
        if self.scales_bytes_per_block not in (0, self.scales_elements_per_block * 4):
            raise FrameError(
                "scales_bytes_per_block",
                f"must be 0 or {self.scales_elements_per_block * 4}, "
                f"got {self.scales_bytes_per_block}",
            )

    @property
    def block_shape(self) -> tuple[int, int, int, int, int]:
        """Shape of one block: `[num_layers, 2, block_size, num_kv_heads, head_dim]`."""
        return (self.num_layers, 2, self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def scales_elements_per_block(self) -> int:
        return self.num_layers * 2 * self.block_size * self.num_kv_heads

    @property
    def kv_bytes_per_block(self) -> int:
        return self.scales_elements_per_block * self.head_dim * ITEMSIZE[self.dtype]

    @property
    def bytes_per_block(self) -> int:
        """Wire bytes of one block: scales (if any) plus KV."""
        return self.kv_bytes_per_block + self.scales_bytes_per_block

    def check_compatible(self, other: KVLayout) -> None:
        """Raise `LayoutMismatchError` naming the first differing field and both values."""
        for field in dataclasses.fields(self):
            ours, theirs = getattr(self, field.name), getattr(other, field.name)
            if ours != theirs:
                raise LayoutMismatchError(field.name, ours, theirs)

    def to_bytes(self) -> bytes:
        """Canonical wire encoding (sorted JSON of plain values; never pickle)."""
        return json.dumps(dataclasses.asdict(self), sort_keys=True).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> KVLayout:
        """Decode `to_bytes`; raise `FrameError` on anything else."""
        try:
            raw: Any = json.loads(data.decode())
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise FrameError("layout", f"not a layout encoding: {exc}") from None
        if not isinstance(raw, dict):
            raise FrameError("layout", "not an object")
        names = {f.name for f in dataclasses.fields(cls)}
        if set(raw) != names:
            raise FrameError("layout", f"fields {sorted(raw)} != {sorted(names)}")
        for field in dataclasses.fields(cls):
            expected = int if field.type in ("int", int) else str
            if type(raw[field.name]) is not expected:
                raise FrameError(field.name, f"must be {expected.__name__}")
        return cls(**raw)

    @classmethod
    def of(cls, cache: Any, scales: Any = None, *, model_id: str = "", kv_dtype: str = "auto"):
        """Describe a block-major cache tensor (and optional scales tensor)."""
        if cache.dim() != 6 or cache.shape[2] != 2:
            raise FrameError("cache", f"expected [N, L, 2, bs, H, D], got {tuple(cache.shape)}")
        _, layers, _, block_size, heads, head_dim = cache.shape
        scales_bytes = 0
        if scales is not None:
            if (
                tuple(scales.shape) != tuple(cache.shape[:5])
                or str(scales.dtype) != "torch.float32"
            ):
                raise FrameError("scales", f"expected float32 {tuple(cache.shape[:5])}")
            scales_bytes = layers * 2 * block_size * heads * 4
        return cls(
            num_layers=int(layers),
            num_kv_heads=int(heads),
            head_dim=int(head_dim),
            block_size=int(block_size),
            dtype=str(cache.dtype).removeprefix("torch."),
            kv_dtype=kv_dtype,
            model_id=model_id,
            scales_bytes_per_block=scales_bytes,
        )


def split_hello(payload: bytes | bytearray) -> tuple[KVLayout, dict[str, object]]:
    """A HELLO / HELLO_ACK payload: `KVLayout.to_bytes()`, NUL, backend extras (JSON object)."""
    layout_bytes, _, extra = bytes(payload).partition(b"\0")
    try:
        extras = json.loads(extra or b"{}")
    except ValueError:
        raise FrameError("hello", "bad extras") from None
    if not isinstance(extras, dict):
        raise FrameError("hello", "bad extras")
    return KVLayout.from_bytes(layout_bytes), extras
