"""`LLM`: the offline Python API in vLLM's shape.

    from kvmesh import LLM, SamplingParams
    llm = LLM()                                   # the default model (SmolLM2-135M-Instruct)
    llm = LLM(model="path/to/checkpoint", max_num_seqs=64)
    outputs = llm.generate(["Hello", [1, 2, 3]], SamplingParams(max_tokens=32))
    outputs = llm.chat([{"role": "user", "content": "Hi"}])   # the model's chat template

Keyword arguments are EngineConfig fields. Results come back in prompt order.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

from kvmesh.engine.chat import Message, chat_prompt_ids
from kvmesh.engine.config import EngineConfig
from kvmesh.engine.engine import LLMEngine, PromptInput
from kvmesh.engine.errors import InvalidParameterError
from kvmesh.engine.outputs import RequestOutput
from kvmesh.engine.sampling_params import SamplingParams


class LLM:
    """Loads a model once; `generate` runs batches of prompts to completion."""

    def __init__(self, model: str | None = None, **engine_options: Any) -> None:
        self.engine = LLMEngine(EngineConfig(model=model, **engine_options))
        self._ids = itertools.count()

    def get_tokenizer(self) -> Any:
        return self.engine.tokenizer

    def generate(
        self,
        prompts: PromptInput | Sequence[PromptInput],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt (text or token ids); one RequestOutput per prompt.

        A single SamplingParams applies to all prompts; a sequence gives one per prompt. All
        prompts are validated before any runs (InvalidParameterError names the field).
        """
        batch = _as_prompt_list(prompts)
        params = _params_per_prompt(sampling_params, len(batch))
        for prompt in batch:
            self.engine.encode_prompt(prompt)
        order: list[str] = []
        try:
            for prompt, p in zip(batch, params, strict=True):
                request_id = f"llm-{next(self._ids)}"
                self.engine.add_request(request_id, prompt, p)
                order.append(request_id)
        except InvalidParameterError:
            for request_id in order:
                self.engine.abort_request(request_id)
            raise
        finished: dict[str, RequestOutput] = {}
        while len(finished) < len(order):
            for output in self.engine.step():
                if output.finished:
                    finished[output.request_id] = output
        return [finished[request_id] for request_id in order]

    def chat(
        self,
        messages: Sequence[Message] | Sequence[Sequence[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Generate the assistant's reply to one conversation (a list of {"role", "content"})
        or to each of a list of conversations, rendered with the model's chat template and
        its generation prompt; outputs as `generate`. InvalidParameterError names the field
        (`messages`, `messages[i].role`, ... or `messages[k]...` for the k-th conversation)."""
        conversations, single = _as_conversations(messages)
        max_len = self.engine.parts.max_model_len
        prompts: list[PromptInput] = [
            chat_prompt_ids(
                self.engine.tokenizer, conv, max_len, "messages" if single else f"messages[{k}]"
            )
            for k, conv in enumerate(conversations)
        ]
        return self.generate(prompts, sampling_params)


def _as_conversations(messages: Any) -> tuple[list[Any], bool]:
    """(conversations, whether one was given): a list whose items are lists is a batch."""
    if isinstance(messages, (list, tuple)) and messages and isinstance(messages[0], (list, tuple)):
        return list(messages), False
    return [messages], True


def _as_prompt_list(prompts: PromptInput | Sequence[PromptInput]) -> list[PromptInput]:
    if isinstance(prompts, str):
        return [prompts]
    items: list[Any] = list(prompts)
    if items and all(isinstance(x, int) and not isinstance(x, bool) for x in items):
        return [items]  # one token-id prompt
    return items


def _params_per_prompt(
    params: SamplingParams | Sequence[SamplingParams] | None, count: int
) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * count
    if isinstance(params, SamplingParams):
        return [params] * count
    listed = list(params)
    if len(listed) != count:
        raise InvalidParameterError(
            "sampling_params", f"got {len(listed)} for {count} prompts; give one or one each"
        )
    return listed
