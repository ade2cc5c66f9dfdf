"""Client cancel, deadline expiry and Abort: every block released within one second."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest
from sys_harness import idle, used_blocks, wait_until

from kvmesh.cli.up import LocalSystem
from kvmesh.client import Aborted, AsyncClient, Client, DeadlineExceeded

LONG: dict[str, Any] = {"max_tokens": 1500, "ignore_eos": True, "temperature": 0.0}
PROMPT = list(range(1, 200))  # spans several blocks


def _holding(system: LocalSystem) -> bool:
    return sum(used_blocks(system).values()) > 0


def test_client_cancel_releases_everything(shm_system: tuple[LocalSystem, str]) -> None:
    system, endpoint = shm_system
    with Client(endpoint, timeout=60) as client:
        stream = client.generate(PROMPT, **LONG)
        chunks = iter(stream)
        assert next(chunks).token_ids
        assert _holding(system)  # the observable sees the request's blocks
        stream.cancel()
        wait_until(lambda: idle(system), 1.0, "blocks released after cancel")


def test_deadline_expiry_releases_everything(shm_system: tuple[LocalSystem, str]) -> None:
    system, endpoint = shm_system
    with Client(endpoint) as client, pytest.raises(DeadlineExceeded):
        for _ in client.generate(PROMPT, timeout=1.0, **LONG):
            pass
    wait_until(lambda: idle(system), 1.0, "blocks released after the deadline")


def test_abort_ends_the_stream_and_releases(shm_system: tuple[LocalSystem, str]) -> None:
    system, endpoint = shm_system
    with Client(endpoint, timeout=60) as client:
        stream = client.generate(PROMPT, request_id="abort-me", **LONG)
        started, outcome = threading.Event(), []

        def consume() -> None:
            try:
                for _ in stream:
                    started.set()
            except Aborted as error:
                outcome.append(error)
            finally:
                started.set()

        reader = threading.Thread(target=consume)
        reader.start()
        assert started.wait(30)
        assert client.abort("abort-me") is True
        reader.join(10)
        assert not reader.is_alive() and len(outcome) == 1
        wait_until(lambda: idle(system), 1.0, "blocks released after Abort")
        assert client.abort("abort-me") is False  # idempotent


def test_async_client_closing_the_stream_cancels(shm_system: tuple[LocalSystem, str]) -> None:
    system, endpoint = shm_system

    async def scenario() -> None:
        async with AsyncClient(endpoint, timeout=60) as client:
            stream = client.generate(PROMPT, **LONG)
            async for chunk in stream:
                assert chunk.token_ids
                break
            await stream.aclose()  # type: ignore[attr-defined]

    asyncio.run(scenario())
    wait_until(lambda: idle(system), 1.0, "blocks released after the async stream closed")
