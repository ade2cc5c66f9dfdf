"""Tiny checkpoints on disk that tests in several folders build the same way.

Import as `from tests.checkpoints import byt5_checkpoint` (the repository root is on the test
path)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

# ByT5Tokenizer decodes the ids below this (3 special, 256 bytes, 125 extra ids)
BYT5_TOKENIZER_IDS = 384


def byt5_checkpoint(folder: Path) -> Path:
    """The tiny Llama (`build_tiny_model(folder, "llama", "test", seed=0)`, vocabulary 1024)
    written to `folder` with transformers' ByT5Tokenizer instead of its own tokenizer files: a
    Python tokenizer (no tokenizer.json) whose decode raises ValueError for any id from
    BYT5_TOKENIZER_IDS up, though the model accepts it. Returns `folder`."""
    from transformers import ByT5Tokenizer

    from kvmesh.models.tiny import build_tiny_model

    folder = build_tiny_model(folder, "llama", "test", seed=0)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (folder / name).unlink(missing_ok=True)
    ByT5Tokenizer().save_pretrained(str(folder))
    return folder


def with_generation_config(source: str | Path, folder: Path, **fields: object) -> Path:
    """A copy of the checkpoint folder `source` at `folder` (which must not exist) whose
    generation_config.json also sets `fields` (over the values it had). Returns `folder`."""
    shutil.copytree(source, folder)
    path = folder / "generation_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **fields}))
    return folder
