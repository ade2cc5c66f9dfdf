"""`kvmesh up` engine flags reach its workers, which are warm (kernels loaded) when ready."""

from __future__ import annotations

from pathlib import Path

from sys_harness import CONTROL_ARGS

from kvmesh.cli.main import build_parser
from kvmesh.cli.up import LocalSystem, UpConfig, worker_argv, worker_engine_values
from kvmesh.client import Client
from kvmesh.models import build_tiny_model


def test_up_flags_reach_the_worker_and_it_is_warm_before_ready(tmp_path: Path) -> None:
    model = build_tiny_model(tmp_path / "tiny", "llama", "test")
    args = build_parser().parse_args(["up", "--model", str(model), "--block-size", "32",
                                      "--served-model-name", "tiny-served", "--colocated", "1",
                                      "--num-kv-blocks", "64", "--dtype", "float32"])  # fmt: skip
    engine = worker_engine_values(args)
    config = UpConfig(model=engine.pop("model"), prefill=0, decode=0, colocated=1, port=0,
                      startup_timeout=240.0, drain_seconds=1.0, control_args=CONTROL_ARGS,
                      worker_args=worker_argv(engine, args.served_model_name))  # fmt: skip
    with LocalSystem(config) as system, Client(system.endpoint) as client:
        info = client.model_info()
        assert (info.block_size, info.model_name) == (32, "tiny-served")
        warmup = system.workers[0].ready["warmup"]
        assert warmup["kernels"] in ("loaded", "disabled")  # CPU: built before READY
        assert warmup["step_seconds"] > 0
        assert client.complete([3, 4, 5], max_tokens=2).token_ids
