"""The per-request bounds the front door enforces before any worker sees a request.

Every bound is checked on sizes protobuf already knows (lengths of fields, counts of repeated
fields) before anything is copied, rendered or tokenized, so refusing a request costs as much
as parsing it. Model-dependent limits (context length, vocabulary, the engine's stop-string
limits) are the workers'; these bound the memory one request may claim on its way there.
"""

from __future__ import annotations

from dataclasses import dataclass

MIB = 1 << 20


@dataclass(frozen=True)
class RequestLimits:
    # Prompt text in UTF-8 bytes: `text`, or the chat messages' contents together.
    max_prompt_bytes: int = 2 * MIB
    # Prompt token ids given directly (`token_ids.ids`).
    max_prompt_tokens: int = 1 << 20
    # Chat messages in one conversation, and the bytes of one message's role.
    max_messages: int = 4096
    max_role_bytes: int = 64
    # Completions per request (`sampling.n`) and tokens per completion (`sampling.max_tokens`).
    max_n: int = 128
    max_tokens: int = 1 << 20
    # Stop strings: how many and how long each (UTF-8 bytes); stop token ids: how many.
    max_stop_strings: int = 64
    max_stop_string_bytes: int = 1024
    max_stop_token_ids: int = 1024
    # Tokens given a logit bias (`sampling.logit_bias`).
    max_logit_bias_tokens: int = 1024
    max_cache_salt_bytes: int = 256

    def __post_init__(self) -> None:
        bad = [name for name, value in self.__dict__.items() if value < 1]
        if bad:
            raise ValueError(f"{bad[0]} must be at least 1")
