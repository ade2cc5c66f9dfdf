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


def sampling_defaults(setting: str, model_path: Path, hf_config: Any) -> Mapping[str, Any]:
    """The sampling fields `setting` ("auto", "vllm" or a folder) sets for `model_path`'s model,
    checked by SamplingParams' own rules (InvalidParameterError naming `generation_config`)."""
    if setting == NEUTRAL:
        return MappingProxyType({})
    source = model_path if setting == "auto" else Path(setting)
    diff = _diff_dict(source, hf_config, required=setting != "auto")
    found = {key: diff[key] for key in SAMPLING_KEYS if diff.get(key) is not None}
    if "max_new_tokens" in found:
        found["max_tokens"] = found.pop("max_new_tokens")
    try:
        SamplingParams(**found)
    except (InvalidParameterError, TypeError) as exc:
        raise InvalidParameterError(
            "generation_config", f"{source}: its sampling defaults are invalid: {exc}"
        ) from None
    if found:
        LOG.warning(
            "default sampling parameters set by %s's generation_config.json: %s "
            "(--generation-config vllm keeps the neutral ones)", source, found,
        )  # fmt: skip
    return MappingProxyType(found)


def default_params(defaults: Mapping[str, Any]) -> SamplingParams:
    """The SamplingParams of a request that sets nothing (vLLM's `get_default_sampling_params`)."""
    return SamplingParams(**defaults)


def _diff_dict(source: Path, hf_config: Any, required: bool) -> dict[str, Any]:
    """What `source`'s generation config sets beyond transformers' defaults; without the file,
    the generation keys of the model's own config (as vLLM falls back), or an error naming
    `generation_config` for a folder given explicitly."""
    from transformers import GenerationConfig

    with _quiet_transformers():
        try:
            config = GenerationConfig.from_pretrained(source)
        except OSError as exc:
            if required:
                raise InvalidParameterError(
                    "generation_config", f"no generation_config.json in {source}: {exc}"
                ) from None
            try:
                config = GenerationConfig.from_model_config(hf_config)
            except Exception:  # a config transformers cannot read generation keys from
                return {}
        return dict(config.to_diff_dict())


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
