"""`kvmesh up` flags for restarts and drain: defaults, --no-restart, bad values exit 2."""

from __future__ import annotations

import os

import pytest

from kvmesh.cli.main import build_parser, main
from kvmesh.cli.restarts import RestartPolicy
from kvmesh.cli.up import config_from_args, own_disk_dir


def test_restarts_are_on_by_default_with_the_documented_policy() -> None:
    config = config_from_args(build_parser().parse_args(["up"]))
    assert config.restart == RestartPolicy(startup_seconds=180.0)
    assert (config.restart.wedged_seconds, config.restart.crash_loop_limit) == (10.0, 5)
    assert config.drain_seconds == 30.0


def test_restart_and_drain_flags_set_the_config() -> None:
    argv = ["up", "--wedged-seconds", "4", "--crash-loop-limit", "2", "--drain-seconds", "7"]
    config = config_from_args(build_parser().parse_args(argv))
    assert config.restart is not None
    assert (config.restart.wedged_seconds, config.restart.crash_loop_limit) == (4.0, 2)
    assert config.drain_seconds == 7.0
    assert config_from_args(build_parser().parse_args(["up", "--no-restart"])).restart is None


def test_a_bad_restart_value_exits_2_naming_it(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["up", "--crash-loop-limit", "0"]) == 2
    assert "crash_loop_limit is out of range" in capsys.readouterr().err


def test_each_worker_gets_its_own_disk_tier_folder() -> None:
    config = config_from_args(build_parser().parse_args(["up", "--disk-kv-dir", "kv"]))
    decode = own_disk_dir(config.worker_args, "decode-0")
    prefill = own_disk_dir(config.worker_args, "prefill-0")
    assert decode[decode.index("--disk-kv-dir") + 1] == "kv/decode-0"
    assert prefill[prefill.index("--disk-kv-dir") + 1] == "kv/prefill-0"
    assert own_disk_dir(("--disk-kv-dir=kv",), "decode-1") == ("--disk-kv-dir=kv/decode-1",)
    assert own_disk_dir(("--dtype", "float32"), "decode-0") == ("--dtype", "float32")


def test_workers_share_the_usable_cores_unless_threads_are_given(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)))
    parse = build_parser().parse_args
    assert config_from_args(parse(["up"])).worker_threads() == 4  # 1 prefill + 1 decode
    assert config_from_args(parse(["up", "--prefill", "2", "--decode", "3"])).worker_threads() == 1
    assert config_from_args(parse(["up", "--colocated", "1"])).worker_threads() == 8
    assert config_from_args(parse(["up", "--threads", "3"])).worker_threads() == 3
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0})
    assert config_from_args(parse(["up"])).worker_threads() == 1
