"""Which model code runs a step: kvmesh's native executor or transformers' own modules.

    executor="auto"          native when the architecture is covered (`native.build`),
                             else transformers; the choice and its reason are logged
    executor="native"        native, or UnsupportedModelError at load naming what is missing
    executor="transformers"  transformers' model code with kvmesh's paged attention

Both expose the same two calls to the runner: `forward(input_ids, positions, ctx)` -> final
hidden states [T, hidden] and `compute_logits(hidden [S, hidden])` -> logits [S, vocab] in the
model's dtype (the sampler widens them to float32 where it computes with them).
"""

from __future__ import annotations

import logging
from typing import Any, Protocol

import torch

from kvmesh.engine.attention import ForwardContext
from kvmesh.engine.config import EXECUTORS
from kvmesh.engine.errors import UnsupportedModelError

logger = logging.getLogger(__name__)

__all__ = ["EXECUTORS", "Executor", "TransformersExecutor", "choose_executor", "executor_for"]


class Executor(Protocol):
    """What the runner calls per step."""

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor: ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor: ...


class TransformersExecutor:
    """transformers' model code over a flat batch of one (attention through `kvmesh_ctx`)."""

    def __init__(self, model: Any):
        self.model = model

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        output = self.model.model(
            input_ids=input_ids[None],  # [1, T]
            position_ids=positions[None],  # [1, T]
            use_cache=False,
            kvmesh_ctx=ctx,
        )
        return output.last_hidden_state[0]  # type: ignore[no-any-return]  # [T, hidden]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.lm_head(hidden)  # type: ignore[no-any-return]


def choose_executor(requested: str, hf_model: Any, hf_config: Any) -> str:
    """ "native" or "transformers" for `requested` (one of EXECUTORS); see the module doc."""
    from kvmesh.engine.native.build import check_native

    if requested == "transformers":
        return "transformers"
    try:
        check_native(hf_model, hf_config)
    except UnsupportedModelError as error:
        if requested == "native":
            raise UnsupportedModelError(f"--executor native: {error}") from error
        logger.info("executor: transformers (%s)", error)
        return "transformers"
    return "native"


def executor_for(model: Any) -> Executor:
    """The runner's view of a loaded model (a NativeCausalLM is its own executor)."""
    from kvmesh.engine.native.llama import NativeCausalLM

    if isinstance(model, NativeCausalLM):
        return model
    return TransformersExecutor(model)
