"""Default sampling from the model's `generation_config.json`, as vLLM's server and `LLM`
apply it (`--generation-config auto`, vLLM's default): a request that leaves temperature,
top_p, top_k, min_p or a penalty unset gets the model's value, and an open-ended request
(`max_tokens` unset in `LLM`, -1 on the wire, a chat without a length) the model's
`max_new_tokens`. `vllm` keeps the neutral defaults; a folder reads its
`generation_config.json` instead of the model's."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any

from kvmesh.engine.errors import InvalidParameterError
from kvmesh.engine.sampling_params import SamplingParams

LOG = logging.getLogger("kvmesh.engine")
NEUTRAL = "vllm"
# generation_config keys that become sampling defaults (vLLM's list); max_new_tokens is
# renamed max_tokens
SAMPLING_KEYS = ("repetition_penalty", "presence_penalty", "frequency_penalty", "temperature",
                 "top_k", "top_p", "min_p", "max_new_tokens")  # fmt: skip


def sampling_defaults(setting: str, model_generation: Any) -> Mapping[str, Any]:
    """The sampling fields `setting` ("auto", "vllm" or a folder) sets, "auto" reading
    `model_generation` (the GenerationConfig transformers loaded with the model: its
    generation_config.json, else its config's generation keys, as vLLM falls back); checked by
    SamplingParams' own rules (InvalidParameterError naming `generation_config`)."""
    if setting == NEUTRAL:
        return MappingProxyType({})
    config = model_generation if setting == "auto" else _read_folder(Path(setting))
    diff = {} if config is None else config.to_diff_dict()
    found = {key: diff[key] for key in SAMPLING_KEYS if diff.get(key) is not None}
    if "max_new_tokens" in found:
        found["max_tokens"] = found.pop("max_new_tokens")
    try:
        SamplingParams(**found)
    except (InvalidParameterError, TypeError) as exc:
        raise InvalidParameterError(
            "generation_config", f"{_source(setting)}: its sampling defaults are invalid: {exc}"
        ) from None
    if found:
        LOG.warning(
            "default sampling parameters set by %s: %s "
            "(--generation-config vllm keeps the neutral ones)", _source(setting), found,
        )  # fmt: skip
    return MappingProxyType(found)


def default_params(defaults: Mapping[str, Any]) -> SamplingParams:
    """The SamplingParams of a request that sets nothing (vLLM's `get_default_sampling_params`)."""
    return SamplingParams(**defaults)


def _source(setting: str) -> str:
    return "the model's generation_config.json" if setting == "auto" else setting


def _read_folder(folder: Path) -> Any:
    """The GenerationConfig of `folder`'s generation_config.json (InvalidParameterError naming
    `generation_config` without one)."""
    from transformers import GenerationConfig

    with _quiet_transformers():
        try:
            return GenerationConfig.from_pretrained(folder)
        except OSError as exc:
            raise InvalidParameterError(
                "generation_config", f"no generation_config.json in {folder}: {exc}"
            ) from None


@contextlib.contextmanager
def _quiet_transformers() -> Iterator[None]:
    """transformers warns about sampling keys without `do_sample`; here they are meant."""
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)
