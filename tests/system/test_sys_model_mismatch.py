"""A decode worker that loaded other weights than the prefill worker, with the same config and
tensor shapes (a fine-tune and its base; here tiny models of two seeds), is never paired with
it: the prefill worker's KV would be decoded by another model and the answer would be wrong
without any error. Its layout's model fingerprint differs, so the control plane finds no
serving pair until a decode worker with the prefill worker's weights registers."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import pytest
from sys_harness import CONTROL_ARGS, WORKER_ARGS, live_workers, wait_until

from kvmesh.cli.up import LocalSystem, UpConfig
from kvmesh.client import Client, KvmeshError
from kvmesh.models import build_tiny_model
from kvmesh.service.runtime import model_fingerprint


def test_a_decode_worker_with_other_weights_is_never_paired(tmp_path: Path) -> None:
    a = build_tiny_model(tmp_path / "a", "llama", "test", seed=1)
    b = build_tiny_model(tmp_path / "b", "llama", "test", seed=2)
    assert (a / "config.json").read_bytes() == (b / "config.json").read_bytes()
    assert model_fingerprint(a) != model_fingerprint(b)
    config = UpConfig(model=str(a), port=0, startup_timeout=240.0, drain_seconds=1.0,
                      control_args=CONTROL_ARGS, worker_args=WORKER_ARGS,
                      role_args={"decode": ("--model", str(b))})  # fmt: skip
    system = LocalSystem(config)
    try:
        deadline = time.monotonic() + 240
        system.model_dir = str(a)
        system.start_control(deadline)
        system.start_worker("prefill")  # both load at once: their registration is the wait
        system.start_worker("decode")  # model b
        wait_until(lambda: live_workers(system, "decode") == 1, 90, "decode worker registered")
        wait_until(lambda: live_workers(system, "prefill") == 1, 90, "prefill worker registered")
        with Client(system.endpoint, timeout=10) as client:
            with pytest.raises(KvmeshError):
                client.complete([3, 4, 5, 6], max_tokens=4, temperature=0.0)
            system.config = dataclasses.replace(config, role_args={})
            system.start_worker("decode", deadline)  # model a: a serving pair at last
            wait_until(lambda: live_workers(system, "decode") == 2, 30, "2nd decode registered")
            assert len(client.complete([3, 4, 5, 6], max_tokens=4, temperature=0.0).token_ids) == 4
    finally:
        system.stop()
