"""A `.gguf` file as a checkpoint folder: converted once, cached, reused.

`gguf_checkpoint(file)` returns `cache_root()/models/gguf-<version>-<key>/<name>`, converting
first when that folder does not exist (`kvmesh.models.cache.materialize`: locked, atomic). The
name is the stem of the file as given, a symlink's own (a hub snapshot's `x.gguf` links to
`blobs/<sha256>`), and names the model to clients; a stem that cannot name a folder of its own
(`.`, `..`) is `model` instead. The key is the SHA-256 of the file's whole content, so a file
rewritten or replaced gets a new conversion instead of a stale one, and a copy reuses it.
`convert_gguf(file, out_dir)` is the conversion itself: transformers reads the file (any
architecture its GGUF loader knows; quantized weights are dequantized), and `save_pretrained`
writes config.json, model.safetensors in float32 (the exact dequantized values) and the tokenizer
with its chat template. Its progress goes to stderr.
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
FALLBACK_NAME = "model"
_UNNAMEABLE = frozenset({"", ".", ".."})
_HASH_CHUNK_BYTES = 1 << 20
# Bump when the conversion's output or the key changes, so stale conversions are not reused.
CONVERSION_VERSION = "v2"


def gguf_cache_name(file: Path) -> str:
    """`gguf-<version>-<key>/<name>`: the cache folder of `file`'s conversion, relative to the
    models folder. The key changes whenever the content does; `name` is `checkpoint_name(file)`."""
    return f"gguf-{CONVERSION_VERSION}-{file_sha256(file)[:16]}/{checkpoint_name(file)}"


def checkpoint_name(file: Path) -> str:
    """The stem of `file` as given (not of a symlink's target), or `model` when that stem would
    not name a folder of its own (empty, `.` or `..`; a stem never holds a separator)."""
    stem = file.stem
    return FALLBACK_NAME if stem in _UNNAMEABLE else stem


def file_sha256(file: Path) -> str:
    """The hex SHA-256 of `file`'s whole content, read in 1 MiB chunks (a symlink is followed).
    A loop rather than `hashlib.file_digest`, which Python 3.10 lacks."""
    digest = hashlib.sha256()
    with open(file, "rb") as handle:
        while chunk := handle.read(_HASH_CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def gguf_checkpoint(
    file: str | os.PathLike[str], lock_timeout: float = BUILD_LOCK_TIMEOUT_SECONDS
) -> Path:
    """The cached checkpoint folder of a `.gguf` file, converted first if needed.

    Raises InvalidParameterError("model", ...) when the file is missing or transformers cannot
    convert it; nothing is left in the cache then.
    """
    path = Path(file).expanduser().absolute()  # not resolved: a symlink keeps its own name
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
