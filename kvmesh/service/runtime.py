"""What every worker role shares: identity, KV layout, model info and request preparation."""

from __future__ import annotations

import dataclasses
import hashlib
import os
import struct
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import grpc

from kvmesh.engine.async_engine import AsyncLLMEngine
from kvmesh.engine.chat import (
    ChatOptions,
    chat_prompt_ids,
    check_text_size,
    has_chat_template,
    parse_documents,
    parse_template_kwargs,
)
from kvmesh.engine.disagg import build_request
from kvmesh.engine.engine import LLMEngine
from kvmesh.engine.errors import InvalidParameterError
from kvmesh.engine.sampling_params import (
    MAX_LOGPROBS,
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
)
from kvmesh.engine.sequence import Request
from kvmesh.models.resolve import model_name
from kvmesh.service.convert import sampling_from_proto, with_defaults
from kvmesh.service.limits import check_prompt_ids_size, check_prompt_size, check_sampling_size
from kvmesh.service.prepare_pool import PreparePool, prompt_bytes
from kvmesh.service.status import ServiceError, abort_with
from kvmesh.v1 import generation_pb2, worker_pb2

LAYOUT_NAME = "block-major-v1"


def new_epoch() -> int:
    """A random non-zero 64-bit incarnation number."""
    return int.from_bytes(os.urandom(8), "little") or 1


FINGERPRINT_SAMPLES = 64  # windows of each safetensors file's tensor data that are hashed
FINGERPRINT_WINDOW = 4096


def model_fingerprint(model_dir: Path) -> str:
    """Hash of config.json, the safetensors headers and samples of the tensor data: equal
    weights, equal hash. The samples (FINGERPRINT_SAMPLES windows spread over each file's
    data, all of it when smaller) tell apart checkpoints of one shape with other weights (a
    fine-tune and its base, tiny models of two seeds), whose configs and headers are equal:
    a prefill worker's KV must never reach a decode worker that runs other weights."""
    digest = hashlib.sha256()
    config = model_dir / "config.json"
    if config.exists():
        digest.update(config.read_bytes())
    for path in sorted(model_dir.glob("*.safetensors")):
        with path.open("rb") as handle:
            (size,) = struct.unpack("<Q", handle.read(8))
            digest.update(handle.read(min(size, 64 << 20)))
            _hash_samples(handle, 8 + size, path.stat().st_size, digest)
    return digest.hexdigest()[:32]


def _hash_samples(handle: Any, start: int, end: int, digest: Any) -> None:
    """Hash FINGERPRINT_SAMPLES windows spread evenly over bytes [start, end) of `handle`
    (first and last included), or every byte when the range is not larger than them."""
    length = max(0, end - start)
    if length <= FINGERPRINT_SAMPLES * FINGERPRINT_WINDOW:
        handle.seek(start)
        digest.update(handle.read(length))
        return
    step = (length - FINGERPRINT_WINDOW) / (FINGERPRINT_SAMPLES - 1)
    for i in range(FINGERPRINT_SAMPLES):
        handle.seek(start + int(i * step))
        digest.update(handle.read(FINGERPRINT_WINDOW))


def layout_of(engine: LLMEngine, fingerprint: str) -> worker_pb2.KVCacheLayout:
    spec = engine.runner.kv_cache.spec
    return worker_pb2.KVCacheLayout(
        num_layers=spec.num_layers,
        num_kv_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        block_size=spec.block_size,
        dtype=str(spec.dtype).removeprefix("torch."),
        kv_dtype=spec.kv_dtype,
        layout=LAYOUT_NAME,
        model_fingerprint=fingerprint,
    )


def check_layout(ours: worker_pb2.KVCacheLayout, theirs: worker_pb2.KVCacheLayout, where: str):
    """InvalidParameterError-free check: returns the first differing field's message or None."""
    for field in ours.DESCRIPTOR.fields:
        a, b = getattr(ours, field.name), getattr(theirs, field.name)
        if a != b:
            return f"{where}.{field.name}: {b!r} does not match this worker's {a!r}"
    return None


def model_info(
    engine: LLMEngine, mode: str, served_name: str | None = None
) -> generation_pb2.ModelInfo:
    parts = engine.parts
    hf = parts.loaded.hf_config
    archs = getattr(hf, "architectures", None) or [type(parts.loaded.model).__name__]
    return generation_pb2.ModelInfo(
        model_name=served_name or model_name(parts.loaded.path),
        architecture=str(archs[0]),
        vocab_size=engine.runner.vocab_size,
        max_model_len=parts.max_model_len,
        eos_token_id=-1 if parts.eos_token_id is None else parts.eos_token_id,
        has_tokenizer=engine.tokenizer is not None,
        block_size=engine.runner.block_size,
        mode=mode,
        max_stop_strings=MAX_STOP_STRINGS,
        max_stop_string_chars=MAX_STOP_STRING_CHARS,
        max_logprobs=MAX_LOGPROBS,
        has_chat_template=has_chat_template(engine.tokenizer),
    )


@dataclasses.dataclass
class WorkerRuntime:
    """One worker process's engine (its thread, via AsyncLLMEngine) and identity."""

    engine: AsyncLLMEngine
    worker_id: str
    epoch: int
    layout: worker_pb2.KVCacheLayout
    model: generation_pb2.ModelInfo
    warmup: dict[str, Any] = dataclasses.field(default_factory=dict)  # WarmupReport.as_dict
    prepare_pool: PreparePool = dataclasses.field(default_factory=PreparePool)

    @property
    def core(self) -> LLMEngine:
        """The LLMEngine itself: read only what never changes (tokenizer, vocabulary, cache
        tensors) from other threads; everything else goes through `engine.call`."""
        return self.engine.engine

    def kv_cache_tensors(self) -> tuple[Any, Any]:
        """The paged KV cache (`[num_blocks, ...]`) and its scales (None unless quantized), the
        tensors a KV transfer BlockStore reads and writes."""
        cache = self.core.runner.kv_cache
        return cache.data, getattr(cache, "scales", None)

    def load_proto(self) -> worker_pb2.WorkerLoad:
        load = self.engine.load()
        return worker_pb2.WorkerLoad(
            total_blocks=load.total_blocks,
            free_blocks=load.free_blocks,
            cached_blocks=load.cached_blocks,
            running=load.running,
            waiting=load.waiting,
        )

    async def serve_prepare(
        self, request: worker_pb2.PrepareRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.PrepareResponse:
        """PrefillService.Prepare of every role: the prepared request, or INVALID_ARGUMENT
        naming the field. Rendering and tokenizing (bounded in size) run in a thread of the
        prepare pool, so the event loop (heartbeats, streams) never waits for them; when its
        lane for large prompts is full, RESOURCE_EXHAUSTED with a retry delay."""
        try:
            return worker_pb2.PrepareResponse(request=await self.prepare_request(request.request))
        except Exception as exc:
            await abort_with(context, exc)
            raise

    async def serve_detokenize(
        self, request: worker_pb2.DetokenizeRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.DetokenizeResponse:
        """PrefillService.Detokenize of every role: the ids decoded by the model's tokenizer
        (in a thread of the prepare pool), INVALID_ARGUMENT naming `token_ids` for more ids
        than the context holds or a negative id, FAILED_PRECONDITION for a model without a
        tokenizer."""
        try:
            self.check_detokenize(request.token_ids)  # before the ids are copied
            ids = list(request.token_ids)
            work = lambda: self.detokenize(ids, request.token_strs)  # noqa: E731
            text, strs = await self.prepare_pool.run(4 * len(ids), work)
            return worker_pb2.DetokenizeResponse(text=text, token_strs=strs)
        except Exception as exc:
            await abort_with(context, exc)
            raise

    def check_detokenize(self, ids: Sequence[int]) -> None:
        if self.core.tokenizer is None:
            raise ServiceError(grpc.StatusCode.FAILED_PRECONDITION, "this model has no tokenizer")
        check_prompt_ids_size(len(ids), self.model.max_model_len, "token_ids")
        if any(i < 0 for i in ids):
            raise InvalidParameterError("token_ids", "token ids must be >= 0")

    def detokenize(self, ids: list[int], token_strs: bool) -> tuple[str, list[str]]:
        """The ids' text, special tokens kept (transformers' `decode`, as vLLM's /detokenize:
        an id the tokenizer does not know decodes to nothing), and with `token_strs` each id's
        vocabulary entry (`convert_ids_to_tokens`; "" for an unknown id)."""
        tokenizer = self.core.tokenizer
        assert tokenizer is not None  # check_detokenize
        text = str(tokenizer.decode(ids)) if ids else ""
        strs = []
        if token_strs:
            strs = [t or "" for t in tokenizer.convert_ids_to_tokens(ids)]
        return text, strs

    async def prepare_request(
        self, message: generation_pb2.GenerateRequest
    ) -> worker_pb2.EngineRequest:
        """`prepare` in a thread of the prepare pool (size-checked first, before any thread is
        taken); RESOURCE_EXHAUSTED with a retry delay when its lane for large prompts is full."""
        self.check_size(message)
        return await self.prepare_pool.run(prompt_bytes(message), lambda: self.prepare(message))

    def check_size(self, message: generation_pb2.GenerateRequest) -> None:
        """The size bounds of a client request (cheap: lengths only; InvalidParameterError)."""
        check_prompt_size(message, self.model.max_model_len)
        check_sampling_size(message.sampling)

    def prepare(self, message: generation_pb2.GenerateRequest) -> worker_pb2.EngineRequest:
        """Validate and tokenize a client request (InvalidParameterError names the field).
        Safe to call from any thread: it only reads the engine's fixed parts."""
        if not message.request_id:
            raise InvalidParameterError("request_id", "must not be empty")
        self.check_size(message)
        sampling = with_defaults(message.sampling, self.core.parts.sampling_defaults)
        params = sampling_from_proto(sampling)  # checked before any tokenizing
        ids = self.prompt_ids(message)
        # before build_request walks the ids in Python (holding the GIL the event loop needs)
        check_prompt_ids_size(len(ids), self.model.max_model_len, "prompt")
        self.build(message.request_id, ids, params, message.cache_salt)
        return worker_pb2.EngineRequest(
            request_id=message.request_id,
            prompt_ids=ids,
            sampling=sampling,
            cache_salt=message.cache_salt,
        )

    def prompt_ids(self, message: generation_pb2.GenerateRequest) -> list[int]:
        """The prompt's token ids: text tokenized, a conversation rendered with the chat
        template, token ids as given; text is size-checked before any tokenizing."""
        which = message.WhichOneof("prompt")
        tokenizer, max_len = self.core.tokenizer, self.model.max_model_len
        if which == "token_ids":
            return list(message.token_ids.ids)
        if which == "text":
            if tokenizer is None:
                raise InvalidParameterError("prompt.text", "this model has no tokenizer")
            if not message.text:
                raise InvalidParameterError("prompt", "must contain at least one token")
            check_text_size(len(message.text), max_len, "prompt.text")
            special = not message.HasField("add_special_tokens") or message.add_special_tokens
            return list(tokenizer.encode(message.text, add_special_tokens=special))
        if which == "chat":
            if not has_chat_template(tokenizer):
                raise InvalidParameterError("prompt.chat", "this model has no chat template")
            if message.HasField("add_special_tokens"):
                raise InvalidParameterError(
                    "add_special_tokens", "is for text prompts: set chat.add_special_tokens"
                )
            chat = [
                {"role": m.role, "content": m.content, **({"name": m.name} if m.name else {})}
                for m in message.chat.messages
            ]
            options = chat_options(message.chat, max_len)
            return chat_prompt_ids(
                tokenizer, chat, max_len, "prompt.chat.messages", options, "prompt.chat."
            )
        raise InvalidParameterError("prompt", "set text, token_ids or chat")

    def request_from(self, message: worker_pb2.EngineRequest, prefill_only: bool) -> Request:
        """The engine Request of a prepared request, re-validated (a worker trusts no caller);
        its sizes are checked before anything is converted."""
        if not message.request_id:
            raise InvalidParameterError("request_id", "must not be empty")
        check_prompt_ids_size(len(message.prompt_ids), self.model.max_model_len, "prompt.token_ids")
        check_sampling_size(message.sampling)
        sampling = with_defaults(message.sampling, self.core.parts.sampling_defaults)
        params = sampling_from_proto(sampling)
        return self.build(
            message.request_id, message.prompt_ids, params, message.cache_salt, prefill_only
        )

    def build(self, request_id, ids, params, salt: bytes, prefill_only: bool = False) -> Request:
        try:
            return build_request(
                self.core, request_id, ids, params, extra_key=salt, prefill_only=prefill_only
            )
        except InvalidParameterError as exc:
            if exc.field == "prompt_token_ids":
                raise InvalidParameterError("prompt.token_ids", exc.message) from None
            raise


def chat_options(chat: generation_pb2.ChatMessages, max_model_len: int) -> ChatOptions:
    """The rendering options of a conversation (InvalidParameterError naming
    `prompt.chat.template_kwargs` or `prompt.chat.documents` for bad JSON)."""
    return ChatOptions(
        add_generation_prompt=(
            not chat.HasField("add_generation_prompt") or chat.add_generation_prompt
        ),
        continue_final_message=chat.continue_final_message,
        add_special_tokens=chat.add_special_tokens,
        template_kwargs=parse_template_kwargs(chat.template_kwargs, "prompt.chat.template_kwargs"),
        documents=parse_documents(chat.documents, max_model_len, "prompt.chat.documents"),
    )
