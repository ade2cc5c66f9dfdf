"""Worker roles on real grpc.aio servers in a background event loop, for the service tests."""

from __future__ import annotations

import asyncio
import sys
import threading
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any, TypeVar

import grpc
import pytest

from kvmesh.engine.config import EngineConfig
from kvmesh.models.tiny import build_tiny_model
from kvmesh.security import Security
from kvmesh.service.options import build_runtime
from kvmesh.service.runtime import WorkerRuntime
from kvmesh.service.server import WorkerServer

T = TypeVar("T")
NUM_BLOCKS = 48
TRANSFER_THREADS = ("kv-", "kvmesh-")  # thread names of kv_transfer and of engine threads
BLOCK_SIZE = 16


class LoopThread:
    """An asyncio loop on its own thread; `run(coro)` waits for the result (bounded)."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = 60.0) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        """Stop the loop and its executor threads, then close it (all bounded)."""
        self.run(self.loop.shutdown_default_executor(), timeout=10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        if not self.thread.is_alive():
            self.loop.close()


class RunningWorker:
    """One role's runtime + server, started on a LoopThread."""

    def __init__(self, loop: LoopThread, runtime: WorkerRuntime, server: WorkerServer, role: Any):
        self.loop, self.runtime, self.server, self.role = loop, runtime, server, role
        self.channel = grpc.insecure_channel(server.address)

    @property
    def address(self) -> str:
        return self.server.address

    def free_blocks(self) -> int:
        return self.runtime.engine.load().free_blocks

    def stop(self) -> None:
        self.channel.close()
        self.loop.run(self.server.drain(0.5))
        self.loop.run(self.role.close())
        self.runtime.prepare_pool.close()
        self.runtime.engine.stop()


def engine_config(model_dir: Path, **overrides: Any) -> EngineConfig:
    options: dict[str, Any] = {
        "model": str(model_dir),
        "num_kv_blocks": NUM_BLOCKS,
        "block_size": BLOCK_SIZE,
        "max_num_batched_tokens": 64,
        "max_model_len": 256,
        "num_threads": 1,
    }
    options.update(overrides)
    return EngineConfig(**options)


def start_worker(
    loop: LoopThread,
    config: EngineConfig,
    role: str,
    install: Callable[..., Any],
    args: Any = None,
    security: Security | None = None,
) -> RunningWorker:
    runtime = build_runtime(config, role, f"{role}-test")

    async def setup() -> tuple[WorkerServer, Any]:
        server = WorkerServer("127.0.0.1", 0, reflection=True, security=security)
        services = await install(runtime, server, args, None)
        await server.start()
        return server, services

    server, services = loop.run(setup())
    return RunningWorker(loop, runtime, server, services)


def wait_until(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    """Poll `predicate` until true; fail naming `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.01)


@pytest.fixture(scope="session")
def svc_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("svc-llama"), "llama", "test", seed=0)


def close_transfer_links(timeout: float = 5.0) -> list[str]:
    """Shut the gloo sender links kv_transfer pools for reuse (otherwise kept until exit) and
    wait for the receivers' link threads to end: a thread still inside gloo when the
    interpreter exits aborts the process. Returns the names of threads still alive."""
    links = sys.modules.get("kv_transfer.backends.gloo_link")
    if links is not None:
        links.POOL.close_all()
    deadline = time.monotonic() + timeout
    while True:
        left = [t.name for t in threading.enumerate() if t.name.startswith(TRANSFER_THREADS)]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.01)


@pytest.fixture(scope="session")
def svc_loop() -> Any:
    loop = LoopThread()
    yield loop
    loop.close()
    left = close_transfer_links()
    assert not left, f"transfer threads still running after every worker stopped: {left}"
