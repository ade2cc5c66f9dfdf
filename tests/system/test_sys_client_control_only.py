"""The client against a real control plane process with no workers: typed errors, no hangs."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from collections.abc import Iterator

import grpc
import pytest

from kvmesh.cli.supervisor import Supervisor
from kvmesh.cli.up import CONTROL_READY, kvmesh_argv
from kvmesh.client import (
    NO_RETRY,
    AsyncClient,
    Client,
    InvalidArgument,
    KvmeshError,
    NotFound,
    Unavailable,
)


@pytest.fixture(scope="module")
def endpoint() -> Iterator[str]:
    supervisor = Supervisor(grace=3.0)
    try:
        argv = [*kvmesh_argv(), "serve", "control", "--port", "0", "--internal-port", "0",
                "--insecure-no-auth", "--drain-seconds", "1"]  # fmt: skip
        child = supervisor.start("control", argv)
        yield supervisor.wait_for(child, CONTROL_READY, time.monotonic() + 60).group(1)
    finally:
        supervisor.close()


def test_no_workers_is_unavailable_and_not_serving(endpoint: str) -> None:
    with Client(endpoint, timeout=10) as client:
        assert not client.serving()
        with pytest.raises(Unavailable) as failure:
            client.complete("hello", max_tokens=4)
        assert failure.value.code == grpc.StatusCode.UNAVAILABLE
        with pytest.raises(Unavailable):
            client.model_info()


def test_structural_errors_name_the_field(endpoint: str) -> None:
    with Client(endpoint, timeout=10) as client:
        with pytest.raises(InvalidArgument, match="text"):
            client.complete("")
        with pytest.raises(InvalidArgument, match="token_ids"):
            client.complete([])
        with pytest.raises(InvalidArgument, match="max_tokens"):
            client.complete("hi", max_tokens=0)
        with pytest.raises(InvalidArgument, match="request_id"):
            client.complete("hi", request_id="x" * 129)
        with pytest.raises(TypeError, match="temprature"):
            client.complete("hi", temprature=0.5)


def test_abort_unknown_id_is_not_found(endpoint: str) -> None:
    with Client(endpoint, timeout=10) as client:
        with pytest.raises(NotFound, match="never-seen"):
            client.abort("never-seen")
        with pytest.raises(InvalidArgument, match="request_id"):
            client.abort("")


def test_async_client_maps_errors_the_same_way(endpoint: str) -> None:
    async def scenario() -> None:
        async with AsyncClient(endpoint, timeout=10) as client:
            with pytest.raises(NotFound):
                await client.abort("never-seen")
            with pytest.raises(InvalidArgument, match="text"):
                await client.complete("")
            with pytest.raises(Unavailable):
                await client.model_info()

    asyncio.run(scenario())


def test_a_call_without_deadline_to_a_frozen_control_plane_ends_unavailable() -> None:
    """A control plane frozen (SIGSTOP) under an established connection: a call without a
    deadline ends UNAVAILABLE by the client's keepalive (about 15 s), never hangs."""
    supervisor = Supervisor(grace=3.0)
    try:
        argv = [*kvmesh_argv(), "serve", "control", "--port", "0", "--internal-port", "0",
                "--insecure-no-auth", "--drain-seconds", "1"]  # fmt: skip
        child = supervisor.start("control", argv)
        endpoint = supervisor.wait_for(child, CONTROL_READY, time.monotonic() + 60).group(1)
        with Client(endpoint, retry=NO_RETRY) as client:  # no timeout: the default
            with pytest.raises(NotFound):
                client.abort("never-seen")  # the connection is up
            os.kill(child.pid, signal.SIGSTOP)
            try:
                ended: list[tuple[KvmeshError, float]] = []

                def call() -> None:
                    started = time.monotonic()
                    try:
                        client.abort("frozen")
                    except KvmeshError as error:
                        ended.append((error, time.monotonic() - started))

                caller = threading.Thread(target=call, daemon=True)
                caller.start()
                caller.join(40)
                assert ended, "the call was still waiting 40 s after the control plane froze"
                error, seconds = ended[0]
                assert isinstance(error, Unavailable) and seconds < 30
            finally:
                os.kill(child.pid, signal.SIGCONT)
    finally:
        supervisor.close()
