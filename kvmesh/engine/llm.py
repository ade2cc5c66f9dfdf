"""`LLM`: the offline Python API in vLLM's shape.

    from kvmesh import LLM, SamplingParams
    llm = LLM()                                   # the default model (SmolLM2-135M-Instruct)
    llm = LLM(model="path/to/checkpoint", max_num_seqs=64)
    outputs = llm.generate(["Hello", [1, 2, 3]], SamplingParams(max_tokens=32))
    outputs = llm.generate({"prompt_token_ids": [1, 2, 3]}, use_tqdm=True)   # vLLM's dicts
    outputs = llm.chat([{"role": "user", "content": "Hi"}])   # the model's chat template
    outputs = llm.chat(messages, add_generation_prompt=False, continue_final_message=True,
                       chat_template_kwargs={"enable_thinking": False})   # vLLM's options

    with LLM(disk_kv_dir="kv", disk_kv_persist=True) as llm:   # closed at the block's end
        llm.generate(...)

Keyword arguments are EngineConfig fields. Results come back in prompt order. Logprobs read as
vLLM's: `for token_id, lp in out.outputs[0].logprobs[i].items(): lp.logprob, lp.rank,
lp.decoded_token` (and `out.prompt_logprobs`, None first), the texts as vLLM decodes them.
"""

from __future__ import annotations

import itertools
import os
import weakref
from collections.abc import Callable, Mapping, Sequence
from types import TracebackType
from typing import Any

from kvmesh.engine.chat import ChatOptions, Message, chat_prompt_text, rendered_ids
from kvmesh.engine.config import EngineConfig
from kvmesh.engine.engine import LLMEngine, PromptInput
from kvmesh.engine.errors import InvalidParameterError
from kvmesh.engine.generation_defaults import default_params
from kvmesh.engine.logprobs import DecodedTokens
from kvmesh.engine.outputs import RequestOutput
from kvmesh.engine.sampling_params import SamplingParams

# The keys of vLLM's TextPrompt and TokensPrompt that kvmesh honours; any other one (multimodal
# data, a cache salt, ...) would change the answer, so it is refused by name.
DICT_PROMPT_KEYS = frozenset({"prompt", "prompt_token_ids"})
# The keys of vLLM's `LLM.chat(tokenization_kwargs=...)` that kvmesh honours.
TOKENIZATION_KEYS = frozenset({"add_special_tokens"})
PromptLike = PromptInput | Mapping[str, Any]


class LLM:
    """Loads a model once; `generate` runs batches of prompts to completion.

    `close()` (or leaving a `with LLM(...) as llm:` block) releases the engine: a persistent
    disk tier (`disk_kv_persist`) receives the device's and host's cached blocks, and the disk
    folder is free for the next engine. An LLM dropped without `close` (collected, or still
    alive at interpreter exit) is closed then; its engine is not to be used after that."""

    def __init__(self, model: str | None = None, **engine_options: Any) -> None:
        self.engine = LLMEngine(EngineConfig(model=model, **engine_options))
        self._ids = itertools.count()
        self._decoded: DecodedTokens | None = None  # made when logprobs are first decoded
        # Holds the engine, never this LLM: a dropped LLM is collected, which runs it.
        self._closer = weakref.finalize(self, _close_engine, self.engine, os.getpid())

    def close(self) -> None:
        """Close the engine (a persistent disk tier is written down, see the class).
        Idempotent; `generate` and `chat` refuse to run afterwards."""
        self._closer()

    @property
    def closed(self) -> bool:
        return not self._closer.alive

    def __enter__(self) -> LLM:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

    def get_tokenizer(self) -> Any:
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """What a prompt without SamplingParams samples with: the model's generation_config
        sampling (`EngineConfig.generation_config`), else the neutral defaults (vLLM's)."""
        return default_params(self.engine.parts.sampling_defaults)

    def generate(
        self,
        prompts: PromptLike | Sequence[PromptLike],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool | Callable[..., Any] = False,
    ) -> list[RequestOutput]:
        """Generate for every prompt (text, token ids, or vLLM's `{"prompt": text}` and
        `{"prompt_token_ids": ids}` dicts); one RequestOutput per prompt, in prompt order.

        A single SamplingParams applies to all prompts; a sequence gives one per prompt; None,
        the model's defaults (its generation_config.json's sampling, as vLLM's). All
        prompts are validated before any runs (InvalidParameterError names the field, or the
        key of a dict prompt kvmesh cannot honour). `use_tqdm` True (or a tqdm-like factory)
        shows a progress bar of finished prompts on stderr (vLLM's option; off by default).
        Logprobs carry each token's text (`Logprob.decoded_token`) unless detokenize=False.
        """
        if self.closed:
            raise RuntimeError("this LLM is closed")
        batch = _as_prompt_list(prompts)
        params = _params_per_prompt(
            sampling_params, len(batch), self.engine.parts.sampling_defaults
        )
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
        outputs = self._run(order, use_tqdm)
        self._decode_logprobs(outputs, params)
        return outputs

    def _run(self, order: list[str], use_tqdm: bool | Callable[..., Any]) -> list[RequestOutput]:
        """Step until every request of `order` finished; their final outputs in that order."""
        bar = _progress_bar(use_tqdm, len(order))
        finished: dict[str, RequestOutput] = {}
        try:
            while len(finished) < len(order):
                for output in self.engine.step():
                    if output.finished:
                        finished[output.request_id] = output
                        if bar is not None:
                            bar.update(1)
        finally:
            if bar is not None:
                bar.close()
        return [finished[request_id] for request_id in order]

    def _decode_logprobs(self, outputs: list[RequestOutput], params: list[SamplingParams]) -> None:
        """Give the logprobs of `outputs` (one per params) their tokens' texts, as vLLM's
        `decoded_token` (none without a tokenizer or with detokenize=False)."""
        tokenizer = self.engine.tokenizer
        for output, p in zip(outputs, params, strict=True):
            if tokenizer is None or not p.detokenize:
                continue
            if p.logprobs is None and p.prompt_logprobs is None:
                continue
            if self._decoded is None:
                self._decoded = DecodedTokens(tokenizer)
            if output.prompt_logprobs is not None:
                output.prompt_logprobs = self._decoded.entries(output.prompt_logprobs)
            for completion in output.outputs:
                if completion.logprobs is not None:
                    decoded = self._decoded.entries(completion.logprobs)
                    completion.logprobs = [e for e in decoded if e is not None]

    def chat(
        self,
        messages: Sequence[Message] | Sequence[Sequence[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool | Callable[..., Any] = False,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        tokenization_kwargs: Mapping[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Generate the assistant's reply to one conversation (a list of {"role", "content"})
        or to each of a list of conversations, rendered with the model's chat template and
        its generation prompt; outputs and `use_tqdm` as `generate`, each output's `prompt`
        the rendered text (vLLM's). InvalidParameterError names the field (`messages`,
        `messages[i].role`, ... or `messages[k]...` for the k-th conversation).

        The rendering options are vLLM's `LLM.chat` keywords, with its defaults and meaning:
        `add_generation_prompt` (append the header opening the assistant's turn),
        `continue_final_message` (leave the final message open for the model to continue;
        needs add_generation_prompt=False), `chat_template_kwargs` (extra template variables,
        e.g. `{"enable_thinking": False}` or `{"documents": [...]}`; variables the template
        does not read and apply_chat_template's own arguments are dropped, the keywords here
        win), `tokenization_kwargs={"add_special_tokens": True}` (the tokenizer's special
        tokens on top of the template's; its only key kvmesh takes) and `chat_template` (a
        Jinja template, or a named template of the tokenizer, rendering instead of the
        model's; as in vLLM `chat_template_kwargs["chat_template"]` is one too). `tools` is
        refused (tool calling is not supported).
        """
        options = _chat_options(
            chat_template, add_generation_prompt, continue_final_message, tools,
            chat_template_kwargs, tokenization_kwargs,
        )  # fmt: skip
        conversations, single = _as_conversations(messages)
        tokenizer: Any = self.engine.tokenizer  # not None once a template rendered
        max_len = self.engine.parts.max_model_len
        texts = [
            _offline_names(
                chat_prompt_text,
                tokenizer,
                conv,
                max_len,
                "messages" if single else f"messages[{k}]",
                options,
            )
            for k, conv in enumerate(conversations)
        ]
        prompts: list[PromptInput] = [
            rendered_ids(tokenizer, text, options.add_special_tokens) for text in texts
        ]
        outputs = self.generate(prompts, sampling_params, use_tqdm=use_tqdm)
        for output, text in zip(outputs, texts, strict=True):
            output.prompt = text  # vLLM's: the rendered conversation
        return outputs


def _close_engine(engine: LLMEngine, owner: int) -> None:
    """An LLM's finalizer: close its engine, in the process that made it only (a forked
    child's copy of the engine shares its parent's disk folder)."""
    if os.getpid() == owner:
        engine.close()


def _chat_options(
    chat_template: Any,
    add_generation_prompt: Any,
    continue_final_message: Any,
    tools: Any,
    chat_template_kwargs: Any,
    tokenization_kwargs: Any,
) -> ChatOptions:
    """The ChatOptions of `LLM.chat`'s keywords (InvalidParameterError naming the keyword, or
    `keyword.KEY`, for a value kvmesh cannot honour)."""
    for name, flag in (
        ("add_generation_prompt", add_generation_prompt),
        ("continue_final_message", continue_final_message),
    ):
        if not isinstance(flag, bool):
            raise InvalidParameterError(name, "must be True or False")
    if tools:
        raise InvalidParameterError("tools", "tool calling is not supported")
    kwargs = _mapping(chat_template_kwargs, "chat_template_kwargs")
    if kwargs.get("tools"):
        raise InvalidParameterError("chat_template_kwargs.tools", "tool calling is not supported")
    template = kwargs.pop("chat_template", None)  # vLLM: the keyword wins over this one
    where = "chat_template_kwargs.chat_template"
    if chat_template is not None:
        template, where = chat_template, "chat_template"
    if template is not None and not isinstance(template, str):
        raise InvalidParameterError(where, "must be the text of a Jinja template (or its name)")
    tokenization = _mapping(tokenization_kwargs, "tokenization_kwargs")
    for key in tokenization:
        if key not in TOKENIZATION_KEYS:
            raise InvalidParameterError(
                f"tokenization_kwargs.{key}", "is not supported (add_special_tokens is)"
            )
    special = tokenization.get("add_special_tokens", False)
    if not isinstance(special, bool):
        raise InvalidParameterError(
            "tokenization_kwargs.add_special_tokens", "must be True or False"
        )
    return ChatOptions(
        add_generation_prompt=add_generation_prompt,
        continue_final_message=continue_final_message,
        add_special_tokens=special,
        template_kwargs=kwargs,
        template=template,
    )


def _mapping(value: Any, name: str) -> dict[str, Any]:
    """A keyword's dict (None: empty) with string keys; InvalidParameterError naming it."""
    if value is None:
        return {}
    if not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value):
        raise InvalidParameterError(name, "must be a dict with string keys")
    return dict(value)


def _offline_names(render: Callable[..., str], *args: Any) -> str:
    """`render(*args)` with an InvalidParameterError naming the template variables by the
    offline keyword (`chat_template_kwargs...` for `template_kwargs...`)."""
    try:
        return render(*args)
    except InvalidParameterError as exc:
        if exc.field.startswith("template_kwargs"):
            raise InvalidParameterError("chat_" + exc.field, exc.message) from None
        raise


def _as_conversations(messages: Any) -> tuple[list[Any], bool]:
    """(conversations, whether one was given): a list whose items are lists is a batch."""
    if isinstance(messages, (list, tuple)) and messages and isinstance(messages[0], (list, tuple)):
        return list(messages), False
    return [messages], True


def _as_prompt_list(prompts: PromptLike | Sequence[PromptLike]) -> list[PromptInput]:
    """The prompts as text or token ids: one text, token-id list or dict is a single prompt."""
    if isinstance(prompts, (str, Mapping)):
        return [_plain_prompt(prompts)]
    items: list[Any] = list(prompts)
    if items and all(isinstance(x, int) and not isinstance(x, bool) for x in items):
        return [items]  # one token-id prompt
    return [_plain_prompt(item) for item in items]


def _plain_prompt(prompt: Any) -> PromptInput:
    """Text or token ids of a prompt; vLLM's dicts read as vLLM reads them (token ids first).
    InvalidParameterError names a key kvmesh cannot honour, or `prompt` for a dict without
    text or ids."""
    if not isinstance(prompt, Mapping):
        return prompt
    for key in prompt:
        if key not in DICT_PROMPT_KEYS:
            raise InvalidParameterError(str(key), "is not supported in a prompt dict")
    if "prompt_token_ids" in prompt:
        ids = prompt["prompt_token_ids"]
        if isinstance(ids, (str, Mapping)) or not isinstance(ids, Sequence):
            raise InvalidParameterError("prompt_token_ids", "expected a list of token ids")
        return ids
    if not isinstance(prompt.get("prompt"), str):
        raise InvalidParameterError("prompt", "a prompt dict needs text or prompt_token_ids")
    return prompt["prompt"]


def _progress_bar(use_tqdm: bool | Callable[..., Any], total: int) -> Any:
    """A tqdm bar over `total` prompts (from `use_tqdm` when it is a factory), None when off."""
    if not use_tqdm:
        return None
    if callable(use_tqdm):
        factory = use_tqdm
    else:
        from tqdm import tqdm

        factory = tqdm
    return factory(total=total, desc="Processed prompts", unit="prompt", dynamic_ncols=True)


def _params_per_prompt(
    params: SamplingParams | Sequence[SamplingParams] | None,
    count: int,
    defaults: Mapping[str, Any],
) -> list[SamplingParams]:
    """One SamplingParams per prompt; None: the model's defaults (`generation_defaults`)."""
    if params is None:
        return [default_params(defaults)] * count
    if isinstance(params, SamplingParams):
        return [params] * count
    listed = list(params)
    if len(listed) != count:
        raise InvalidParameterError(
            "sampling_params", f"got {len(listed)} for {count} prompts; give one or one each"
        )
    return listed
