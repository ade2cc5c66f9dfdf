"""Disaggregated greedy output is token-identical to the offline engine, per transfer backend."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from sys_harness import GREEDY, idle, local_system, sample, wait_until

from kvmesh.cli.up import LocalSystem
from kvmesh.client import Client

# Ragged: shorter than a block, across block boundaries, several blocks; ids and text.
PROMPTS: list[Any] = [[5, 9, 2], list(range(3, 40)), [(7 * i) % 1000 + 1 for i in range(90)]]
TEXT_PROMPT = "Paged attention keeps the KV cache in fixed-size blocks."


def _remote(endpoint: str, prompts: list[Any]) -> list[list[int]]:
    with Client(endpoint, timeout=120) as client, ThreadPoolExecutor(len(prompts)) as pool:
        results = list(pool.map(lambda p: client.complete(p, **GREEDY), prompts))
    for result in results:
        assert result.finish_reason == "length"
        assert result.usage is not None and result.usage.completion_tokens == len(result.token_ids)
    return [r.token_ids for r in results]


def _backend_installed(name: str) -> bool:
    import importlib.util

    import kv_transfer

    module = kv_transfer.BACKENDS.get(name)
    return module is not None and importlib.util.find_spec(module) is not None


def _prefill_sent(system: LocalSystem, backend: str) -> float:
    prefill = next(w for w in system.workers if w.role == "prefill")
    return sample(
        prefill.ready["metrics_address"], "kvmesh_kv_transfer_bytes_total", backend=backend
    )


def _check(
    system: LocalSystem, endpoint: str, backend: str, prompts: list[Any], offline: Any
) -> None:
    before = _prefill_sent(system, backend)
    assert _remote(endpoint, prompts) == offline(prompts)
    assert _prefill_sent(system, backend) > before  # the KV went through this backend
    wait_until(lambda: idle(system), 2.0, "no blocks held after the requests finished")


def test_shared_memory(shm_system: tuple[LocalSystem, str], offline: Any) -> None:
    system, endpoint = shm_system
    _check(system, endpoint, "shm", [*PROMPTS, TEXT_PROMPT], offline)


@pytest.mark.parametrize("backend", ["gloo"])  # grpc: test_sys_cli.py
def test_other_cpu_backends(backend: str, offline: Any) -> None:
    if not _backend_installed(backend):
        pytest.skip(f"kv_transfer has no {backend} backend in this checkout")
    with local_system(transfer_backend=backend) as (system, endpoint):
        _check(system, endpoint, backend, PROMPTS[1:2], offline)
