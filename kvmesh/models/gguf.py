"""A `.gguf` file as a checkpoint folder: converted once, cached, reused.

`gguf_checkpoint(file)` returns `cache_root()/models/gguf-<version>-<key>/<stem>` (the folder is
named like the file, which names the model to clients), converting first when
that folder does not exist (`kvmesh.models.cache.materialize`: locked, atomic). The key hashes the
file's size, modification time and first and last MiB, so a file rewritten or replaced gets a new
conversion instead of a stale one. `convert_gguf(file, out_dir)` is the conversion itself:
transformers reads the file (any architecture its GGUF loader knows; quantized weights are
dequantized), and `save_pretrained` writes config.json, model.safetensors in float32 (the exact
dequantized values) and the tokenizer with its chat template. Its progress goes to stderr.
"""

from __future__ import annotations

import hashlib
import os
import sys
import time
from pathlib import Path
from typing import Any

from kvmesh.engine.errors import InvalidParameterError
from kvmesh.models.cache import BUILD_LOCK_TIMEOUT_SECONDS, materialize

GGUF_SUFFIX = ".gguf"
_SAMPLE_BYTES = 1 << 20
# Bump when the conversion's output changes, so stale conversions are not reused.
CONVERSION_VERSION = "v1"


def gguf_cache_name(file: Path) -> str:
    """The cache folder of `file`'s conversion, relative to the models folder (changes when the
    file changes)."""
    stat = file.stat()
    digest = hashlib.sha256(f"{stat.st_size}:{stat.st_mtime_ns}:".encode())
    with open(file, "rb") as handle:
        digest.update(handle.read(_SAMPLE_BYTES))
        handle.seek(max(0, stat.st_size - _SAMPLE_BYTES))
        digest.update(handle.read(_SAMPLE_BYTES))
    return f"gguf-{CONVERSION_VERSION}-{digest.hexdigest()[:16]}/{file.stem}"


def gguf_checkpoint(
    file: str | os.PathLike[str], lock_timeout: float = BUILD_LOCK_TIMEOUT_SECONDS
) -> Path:
    """The cached checkpoint folder of a `.gguf` file, converted first if needed.

    Raises InvalidParameterError("model", ...) when the file is missing or transformers cannot
    convert it; nothing is left in the cache then.
    """
    path = Path(file).expanduser().resolve()
    if not path.is_file():
        raise InvalidParameterError("model", f"{str(file)!r}: no such GGUF file")
    return materialize(
        gguf_cache_name(path), lambda staging: convert_gguf(path, staging), lock_timeout
    )


def convert_gguf(file: str | os.PathLike[str], out_dir: str | os.PathLike[str]) -> Path:
    """Write the checkpoint of GGUF `file` into `out_dir` (see module doc); returns `out_dir`."""
    path, out = Path(file), Path(out_dir)
    started = time.monotonic()
    print(f"kvmesh: converting {path.name} into a checkpoint (once)", file=sys.stderr, flush=True)
    try:
        model, tokenizer = _load_gguf(path)
    except Exception as error:  # transformers raises many types for files it cannot read
        reason = (str(error).strip().splitlines() or [type(error).__name__])[0]
        raise InvalidParameterError(
            "model", f"{str(path)!r}: transformers cannot convert this GGUF file ({reason})"
        ) from error
    _save_plain(model, out)
    tokenizer.save_pretrained(str(out))
    elapsed = time.monotonic() - started
    print(f"kvmesh: converted {path.name} in {elapsed:.1f} s", file=sys.stderr, flush=True)
    return out


def _load_gguf(path: Path) -> tuple[Any, Any]:
    """The dequantized float32 model and the tokenizer of one GGUF file (progress on stderr)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig
    from transformers.utils import logging as hf_logging

    hf_logging.enable_progress_bar()
    folder, name = str(path.parent), path.name
    model = AutoModelForCausalLM.from_pretrained(
        folder,
        gguf_file=name,
        dtype=torch.float32,
        quantization_config=GgufConfig(dequantize=True),
        local_files_only=True,
    )
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name, local_files_only=True)
    return model, tokenizer


def _save_plain(model: Any, out: Path) -> None:
    """`save_pretrained` as a plain float32 checkpoint: the weights are already dequantized, so
    the GGUF quantizer transformers attached (which refuses to serialize) is dropped first."""
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(str(out))
