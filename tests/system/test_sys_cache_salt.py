"""Tenant isolation of the prefix cache on a real `kvmesh up` (1 prefill + 1 decode worker):
requests of different cache salts never share KV blocks (a hit would show in `cached_tokens`,
and in the time to first token), while the same salt, and no salt, share as documented; both
through the gRPC door (`GenerateRequest.cache_salt`) and the OpenAI door (vLLM's `cache_salt`).
"""

from __future__ import annotations

from typing import Any

import openai
import pytest
from sys_harness import openai_client

from kvmesh.cli.up import LocalSystem
from kvmesh.client import Client

BLOCK = 16  # the tiny model's KV block size
ONE_TOKEN = {"max_tokens": 1, "temperature": 0.0, "ignore_eos": True}


def prompt(first: int) -> list[int]:
    """Four full blocks and a tail, unlike any other test's prompt."""
    return list(range(first, first + 4 * BLOCK + 3))


def test_grpc_salts_never_share_and_equal_salts_do(openai_system: LocalSystem) -> None:
    ids, hit = prompt(400), 4 * BLOCK
    with Client(openai_system.endpoint) as client:

        def cached(salt: bytes) -> int:
            usage = client.complete(ids, cache_salt=salt, **ONE_TOKEN).completions[0].usage
            assert usage is not None
            return usage.cached_tokens

        assert [cached(b"tenant-a"), cached(b"tenant-b"), cached(b"")] == [0, 0, 0]
        assert [cached(b"tenant-a"), cached(b"tenant-b"), cached(b"")] == [hit, hit, hit]


def cached_tokens(answer: Any) -> int:
    return int(answer.usage.prompt_tokens_details.cached_tokens)


def test_openai_cache_salt_keeps_tenants_apart(openai_system: LocalSystem) -> None:
    """vLLM's `cache_salt` body field salts the prefix cache of completions and chat alike; a
    door that dropped it would serve tenant B from tenant A's KV (a hit across salts)."""
    client = openai_client(openai_system)
    model = client.models.list().data[0].id

    def complete(salt: str | None) -> int:
        extra = {"ignore_eos": True, **({} if salt is None else {"cache_salt": salt})}
        answer = client.completions.create(
            model=model, prompt=prompt(600), max_tokens=1, temperature=0, extra_body=extra
        )
        return cached_tokens(answer)

    assert [complete("a"), complete("b"), complete(None)] == [0, 0, 0]
    assert [complete("a"), complete("b"), complete(None)] == [4 * BLOCK] * 3
    messages: Any = [{"role": "user", "content": "the same long message, " * 6}]

    def chat(salt: str) -> int:
        answer = client.chat.completions.create(
            model=model, messages=messages, max_tokens=1, extra_body={"cache_salt": salt}
        )
        return cached_tokens(answer)

    assert chat("a") == 0 and chat("b") == 0 and chat("a") > 0


@pytest.mark.parametrize(
    "salt, reason", [("", "non-empty"), (7, "expected string"), ("s" * 257, "256 bytes")]
)
def test_openai_bad_cache_salt_is_400_naming_it(
    openai_system: LocalSystem, salt: object, reason: str
) -> None:
    client = openai_client(openai_system)
    with pytest.raises(openai.BadRequestError) as raised:
        client.completions.create(
            model=client.models.list().data[0].id, prompt="x", extra_body={"cache_salt": salt}
        )
    error = raised.value.body
    assert isinstance(error, dict) and error["param"] == "cache_salt"
    assert reason in error["message"]
