"""KV capacity planning: bytes per token, blocks and concurrency that fit in device memory.

Pure Python (no torch). The engine sizes its KV pool with `plan_kv_capacity`; `kvmesh plan`
prints the same plan. Bytes per token follow the articles
“KV Cache与PagedAttention深度解析：vLLM内存管理革命” (§1.2) and
“KV Cache从原理到实战：大模型推理内存管理演进与优化” (§2.2), GQA/MQA-aware:

    kv_bytes_per_token = 2 (K, V) × layers × kv_heads × (head_dim × dtype_bytes + scale_bytes)

`scale_bytes` is the per-token, per-kv-head quantization scale that kvmesh stores next to int8
and fp8 caches (one float32: 4 bytes), and 0 for float caches.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "DTYPE_BYTES",
    "KVCapacityPlan",
    "KVModelShape",
    "PlannerError",
    "parse_bytes",
    "plan_kv_capacity",
    "safetensors_weights_bytes",
]


class PlannerError(ValueError):
    """A model config or planning input is invalid; the message starts with the field name."""


DTYPE_BYTES: dict[str, int] = {"float32": 4, "float16": 2, "bfloat16": 2, "fp8": 1, "int8": 1}
QUANTIZED_KV_DTYPES = frozenset({"fp8", "int8"})
_DTYPE_ALIASES = {
    "float": "float32",
    "fp32": "float32",
    "half": "float16",
    "fp16": "float16",
    "bf16": "bfloat16",
    "float8_e4m3fn": "fp8",
    "float8_e5m2": "fp8",
    "fp8_e4m3": "fp8",
    "fp8_e5m2": "fp8",
}
# Model configs that give no dtype were saved in float32 by transformers.
_DEFAULT_MODEL_DTYPE = "float32"


def normalize_dtype(name: object, field: str) -> str:
    """Canonical dtype name (`float32`, `float16`, `bfloat16`, `fp8`, `int8`) or PlannerError."""
    text = str(name).strip().lower().removeprefix("torch.")
    text = _DTYPE_ALIASES.get(text, text)
    if text not in DTYPE_BYTES:
        raise PlannerError(
            f"{field}: unknown dtype {name!r} (expected one of {sorted(DTYPE_BYTES)})"
        )
    return text


@dataclass(frozen=True)
class KVModelShape:
    """The parts of a decoder config that decide KV cache size."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    num_attention_heads: int
    dtype: str = _DEFAULT_MODEL_DTYPE
    max_position_embeddings: int | None = None
    model_type: str = "unknown"

    def __post_init__(self) -> None:
        for field in ("num_layers", "num_kv_heads", "head_dim", "num_attention_heads"):
            _require_positive_int(getattr(self, field), field)
        if self.max_position_embeddings is not None:
            _require_positive_int(self.max_position_embeddings, "max_position_embeddings")
        if self.num_attention_heads % self.num_kv_heads:
            raise PlannerError(
                f"num_key_value_heads: {self.num_kv_heads} does not divide "
                f"num_attention_heads {self.num_attention_heads}"
            )
        object.__setattr__(self, "dtype", normalize_dtype(self.dtype, "torch_dtype"))

    @classmethod
    def from_config(cls, source: Mapping[str, Any] | str | Path) -> KVModelShape:
        """Read a transformers config: a mapping, a config.json path or a model folder.

        Uses `text_config` when the model nests its decoder config there (multimodal models).
        """
        config = _load_config(source) if isinstance(source, (str, Path)) else dict(source)
        text = config.get("text_config")
        if isinstance(text, Mapping) and "num_hidden_layers" not in config:
            config = {**config, **text}
        layers = _required(config, "num_hidden_layers")
        heads = _required(config, "num_attention_heads")
        kv_heads = config.get("num_key_value_heads")
        kv_heads = heads if kv_heads is None else kv_heads
        for field, value in (
            ("num_hidden_layers", layers),
            ("num_attention_heads", heads),
            ("num_key_value_heads", kv_heads),
        ):
            _require_positive_int(value, field)
        return cls(
            num_layers=layers,
            num_kv_heads=kv_heads,
            head_dim=_head_dim(config, heads),
            num_attention_heads=heads,
            dtype=config.get("torch_dtype") or config.get("dtype") or _DEFAULT_MODEL_DTYPE,
            max_position_embeddings=config.get("max_position_embeddings"),
            model_type=str(config.get("model_type", "unknown")),
        )


@dataclass(frozen=True)
class KVCapacityPlan:
    """How a device's memory splits into weights and paged KV blocks, and what fits."""

    kv_dtype: str
    kv_bytes_per_token: int
    scale_bytes_per_token_head: int
    block_size: int
    block_bytes: int
    memory_bytes: int
    utilization: float
    weights_bytes: int
    activation_reserve_bytes: int
    kv_budget_bytes: int
    num_blocks: int
    token_capacity: int
    max_model_len: int
    max_concurrency: int
    contiguous_max_concurrency: int

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready fields, names as in the dataclass."""
        return asdict(self)


def kv_bytes_per_token(shape: KVModelShape, kv_dtype: str, scale_bytes_per_token_head: int) -> int:
    """2 × layers × kv heads × (head_dim × dtype bytes + scale bytes)."""
    per_head = shape.head_dim * DTYPE_BYTES[kv_dtype] + scale_bytes_per_token_head
    return 2 * shape.num_layers * shape.num_kv_heads * per_head


def plan_kv_capacity(
    shape: KVModelShape,
    *,
    memory_bytes: int,
    utilization: float = 0.9,
    weights_bytes: int = 0,
    block_size: int = 16,
    kv_dtype: str = "auto",
    max_model_len: int | None = None,
    activation_reserve_bytes: int = 0,
    scale_bytes_per_token_head: int | None = None,
) -> KVCapacityPlan:
    """Plan the paged KV pool for `shape` on a device with `memory_bytes`.

    KV budget = memory_bytes × utilization − weights_bytes − activation_reserve_bytes; the
    default activation reserve is 0 (the 1 − utilization headroom covers activations; pass a
    profiled peak to be exact). `kv_dtype="auto"` uses the model dtype. `max_model_len`
    defaults to the config's max_position_embeddings. `scale_bytes_per_token_head` defaults to
    4 (one float32 scale) for int8/fp8 and 0 otherwise. max_concurrency counts sequences of
    max_model_len rounded up to whole blocks; contiguous_max_concurrency is
    floor(budget / (max_model_len × kv_bytes_per_token)).
    """
    _require_positive_int(block_size, "block_size")
    dtype = shape.dtype if kv_dtype == "auto" else normalize_dtype(kv_dtype, "kv_dtype")
    if scale_bytes_per_token_head is None:
        scale_bytes_per_token_head = 4 if dtype in QUANTIZED_KV_DTYPES else 0
    _require_non_negative_int(scale_bytes_per_token_head, "scale_bytes_per_token_head")
    model_len = max_model_len if max_model_len is not None else shape.max_position_embeddings
    if model_len is None:
        raise PlannerError("max_model_len: not given and the config has no max_position_embeddings")
    _require_positive_int(model_len, "max_model_len")
    budget = _kv_budget(memory_bytes, utilization, weights_bytes, activation_reserve_bytes)
    per_token = kv_bytes_per_token(shape, dtype, scale_bytes_per_token_head)
    block_bytes = per_token * block_size
    num_blocks = budget // block_bytes
    return KVCapacityPlan(
        kv_dtype=dtype,
        kv_bytes_per_token=per_token,
        scale_bytes_per_token_head=scale_bytes_per_token_head,
        block_size=block_size,
        block_bytes=block_bytes,
        memory_bytes=memory_bytes,
        utilization=utilization,
        weights_bytes=weights_bytes,
        activation_reserve_bytes=activation_reserve_bytes,
        kv_budget_bytes=budget,
        num_blocks=num_blocks,
        token_capacity=num_blocks * block_size,
        max_model_len=model_len,
        max_concurrency=num_blocks // math.ceil(model_len / block_size),
        contiguous_max_concurrency=budget // (model_len * per_token),
    )


def _kv_budget(memory_bytes: int, utilization: float, weights: int, reserve: int) -> int:
    """memory × utilization − weights − reserve, validated to leave a positive budget."""
    _require_positive_int(memory_bytes, "memory_bytes")
    if not 0.0 < utilization <= 1.0:
        raise PlannerError(f"utilization: {utilization} is not in (0, 1]")
    _require_non_negative_int(weights, "weights_bytes")
    _require_non_negative_int(reserve, "activation_reserve_bytes")
    usable = int(memory_bytes * utilization)
    budget = usable - weights - reserve
    if budget <= 0:
        raise PlannerError(
            f"weights_bytes: weights ({weights} B) + activation reserve ({reserve} B) "
            f"leave no KV budget in {usable} B usable memory"
        )
    return budget


_BYTES_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgtp]?)(i?)(b?)\s*$", re.IGNORECASE)
_POWERS = {"": 0, "k": 1, "m": 2, "g": 3, "t": 4, "p": 5}


def parse_bytes(value: int | str, field: str = "memory_bytes") -> int:
    """Bytes of a size: the one parser of every size kvmesh reads (`kvmesh plan --gpu-memory`,
    `--kv-cache-memory` and `KVMESH_KV_CACHE_MEMORY`).

    A plain number is bytes. An IEC suffix is binary and an SI one decimal, as in Kubernetes
    quantities (`Gi`, `G`) and disk sizes (`GiB`, `GB`), letters in any case, `B` optional:
    `2Gi` = `2GiB` = 2 × 2**30, `2G` = `2GB` = 2 × 10**9; likewise k/Ki, M/Mi, T/Ti, P/Pi.
    A fraction is rounded down to whole bytes (`1.5TiB`). Anything else, and a size under one
    byte, raises PlannerError (a ValueError) whose message starts with `field`.
    """
    if isinstance(value, bool):
        raise PlannerError(f"{field}: {value!r} is not a size")
    if isinstance(value, int):
        _require_positive_int(value, field)
        return value
    match = _BYTES_RE.match(str(value))
    if match is None or (match.group(3) and not match.group(2)):
        raise PlannerError(
            f"{field}: cannot parse size {value!r} (examples: 512MiB, 8GiB or 8Gi = 8 × 2**30, "
            "8GB or 8G = 8 × 10**9, plain bytes)"
        )
    number, prefix, binary, _ = match.groups()
    base = 1024 if binary else 1000
    try:
        result = int(float(number) * base ** _POWERS[prefix.lower()])
    except OverflowError:  # more digits than a float holds
        raise PlannerError(f"{field}: size {value!r} is too large") from None
    _require_positive_int(result, field)
    return result


def safetensors_weights_bytes(folder: str | Path) -> int:
    """Total tensor bytes of the `*.safetensors` files in `folder` (0 when there are none).

    Reads only each file's header (8-byte little-endian length, then JSON); with an
    `model.safetensors.index.json` only the shards it names are counted.
    """
    import json

    root = Path(folder)
    if not root.is_dir():
        return 0
    index = root / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        shards = sorted({root / name for name in weight_map.values()})
    else:
        shards = sorted(root.glob("*.safetensors"))
    return sum(_safetensors_file_bytes(shard) for shard in shards)


def _safetensors_file_bytes(path: Path) -> int:
    import json
    import struct

    try:
        with path.open("rb") as handle:
            (header_len,) = struct.unpack("<Q", handle.read(8))
            header = json.loads(handle.read(header_len))
    except (OSError, struct.error, ValueError) as error:
        raise PlannerError(
            f"weights: cannot read safetensors header of {path.name} ({error})"
        ) from None
    total = 0
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        start, end = entry["data_offsets"]
        total += end - start
    return int(total)


def _load_config(source: str | Path) -> dict[str, Any]:
    import json

    path = Path(source)
    if path.is_dir():
        path = path / "config.json"
    try:
        loaded = json.loads(path.read_text())
    except FileNotFoundError:
        raise PlannerError(f"config: {path} does not exist") from None
    except json.JSONDecodeError as error:
        raise PlannerError(f"config: {path} is not valid JSON ({error.msg})") from None
    if not isinstance(loaded, dict):
        raise PlannerError(f"config: {path} does not hold a JSON object")
    return loaded


def _required(config: Mapping[str, Any], field: str) -> Any:
    if config.get(field) is None:
        raise PlannerError(f"{field}: missing from the model config")
    return config[field]


def _head_dim(config: Mapping[str, Any], heads: int) -> int:
    head_dim = config.get("head_dim")
    if head_dim is not None:
        _require_positive_int(head_dim, "head_dim")
        return int(head_dim)
    hidden = _required(config, "hidden_size")
    _require_positive_int(hidden, "hidden_size")
    if hidden % heads:
        raise PlannerError(f"hidden_size: {hidden} is not divisible by num_attention_heads {heads}")
    return int(hidden // heads)


def _require_non_negative_int(value: object, field: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise PlannerError(f"{field}: {value!r} must be a non-negative integer")


def _require_positive_int(value: object, field: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise PlannerError(f"{field}: {value!r} must be a positive integer")
