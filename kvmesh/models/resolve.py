"""`--model` to a checkpoint folder: the one place every command and API resolves a model.

Accepted, tried in this order:
1. None: the embedded default model (`kvmesh.models.default`).
2. A folder with a config.json: used as it is.
3. A `.gguf` file (or a folder holding exactly one and no config.json): converted once into the
   cache (`kvmesh.models.gguf`).
4. A hub id `Org/Name`: its snapshot in the local Hugging Face cache, found as huggingface_hub
   finds it (`hub_cache_dir`: `HF_HUB_CACHE`, else `HF_HOME/hub`, else
   `$XDG_CACHE_HOME/huggingface/hub`, else `~/.cache/huggingface/hub`), offline; a snapshot is
   then handled as 2/3.

Anything else raises ModelNotFoundError (an InvalidParameterError on field `model`) whose
one-line message says what was tried and how to fix it. Resolution only reads and converts: an
error changes nothing.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from kvmesh.engine.errors import InvalidParameterError
from kvmesh.models.gguf import GGUF_SUFFIX, gguf_checkpoint

HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")
ACCEPTED = "a checkpoint folder (with config.json), a .gguf file, or a hub id Org/Name"


class ModelNotFoundError(InvalidParameterError):
    """`--model` names nothing loadable; the message lists what was tried and the fix."""


def resolve_model_path(model: str | os.PathLike[str] | None) -> Path:
    """The checkpoint folder `model` stands for (see module doc)."""
    if model is None:
        from kvmesh.models.default import default_model_path

        return default_model_path()
    text = os.fspath(model)
    path = Path(text).expanduser()
    if path.is_dir():
        return _from_folder(path, text)
    if path.suffix.lower() == GGUF_SUFFIX:
        if path.is_file():
            return gguf_checkpoint(path)
        raise ModelNotFoundError("model", f"{text!r}: no such .gguf file")
    if path.exists():
        raise ModelNotFoundError("model", f"{text!r} is a file, not {ACCEPTED}")
    if HUB_ID.fullmatch(text):
        return _from_hub_cache(text)
    raise ModelNotFoundError(
        "model", f"{text!r}: no such folder or .gguf file, and not a hub id; expected {ACCEPTED}"
    )


def _from_folder(path: Path, shown: str) -> Path:
    if (path / "config.json").is_file():
        return path
    ggufs = sorted(path.glob(f"*{GGUF_SUFFIX}"))
    if len(ggufs) == 1:
        return gguf_checkpoint(ggufs[0])
    if ggufs:
        names = ", ".join(p.name for p in ggufs)
        raise ModelNotFoundError(
            "model", f"{shown!r} holds several .gguf files ({names}): pass one of them"
        )
    raise ModelNotFoundError(
        "model", f"{shown!r} is a folder without config.json or a .gguf file; expected {ACCEPTED}"
    )


def hub_cache_dir() -> Path:
    """The Hugging Face hub cache this process reads, from the environment at call time, in
    `huggingface_hub.constants`' order: `HF_HUB_CACHE`, `HUGGINGFACE_HUB_CACHE`, `HF_HOME/hub`,
    `$XDG_CACHE_HOME/huggingface/hub`, `~/.cache/huggingface/hub` (empty values count as unset;
    `~` and `$VAR` are expanded)."""
    env = os.environ.get
    explicit = env("HF_HUB_CACHE") or env("HUGGINGFACE_HUB_CACHE")
    if explicit:
        return _expanded(explicit)
    cache_home = env("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    home = env("HF_HOME") or os.path.join(cache_home, "huggingface")
    return _expanded(home) / "hub"


def _expanded(path: str) -> Path:
    """`path` with `~` and then `$VAR` expanded, as huggingface_hub expands its cache paths."""
    return Path(os.path.expandvars(os.path.expanduser(path)))


def _from_hub_cache(repo_id: str) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    cache = hub_cache_dir()
    try:
        snapshot = Path(snapshot_download(repo_id, cache_dir=str(cache), local_files_only=True))
    except (LocalEntryNotFoundError, HFValidationError, OSError):
        raise ModelNotFoundError(
            "model",
            f"{repo_id!r}: no such folder or .gguf file, and no snapshot in the Hugging Face "
            f"cache {cache} (looked offline); download it first (`hf download {repo_id}`), "
            "point HF_HUB_CACHE or HF_HOME at the cache that has it, or pass a folder or "
            ".gguf file",
        ) from None
    return _from_folder(snapshot, f"{repo_id} (snapshot {snapshot})")


def model_name(folder: Path) -> str:
    """A readable name of a resolved folder: `Org/Name` for a hub snapshot, else its name."""
    parts = folder.parts
    if len(parts) >= 3 and parts[-2] == "snapshots" and parts[-3].startswith("models--"):
        return parts[-3].removeprefix("models--").replace("--", "/")
    return folder.name
