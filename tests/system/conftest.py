"""One disaggregated system (1 prefill + 1 decode, shared memory) shared by the system tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from sys_harness import local_system

from kvmesh.cli.up import LocalSystem


@pytest.fixture(scope="session")
def shm_system() -> Iterator[tuple[LocalSystem, str]]:
    with local_system(transfer_backend="shm") as started:
        yield started
