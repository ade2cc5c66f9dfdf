"""`kvmesh tune chunked-prefill`'s printed recommendation starts the system it measured: the
`kvmesh up` line, parsed by `kvmesh up` itself, names the measured topology, threads and the
setting's engine flags. The systems and their measurements are stand-ins (no process starts):
what is checked is the path from the measured `UpConfig` to the printed line. Its parser offers
no flag the tuner would ignore."""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any

import pytest

from kvmesh.cli import tune
from kvmesh.cli.main import build_parser, main
from kvmesh.cli.up import UpConfig, config_from_args, worker_engine_values
from kvmesh.models.tiny import tiny_model_path

SUMMARY = {"itl_ms": {"p50": 5.0, "p99": 9.0}, "ttft_ms": {"p99": 50.0},
           "output_throughput": 100.0, "goodput_output_throughput": 100.0, "completed": 5,
           "failed": 0}  # fmt: skip
MODEL = str(tiny_model_path())


def stand_ins(monkeypatch: pytest.MonkeyPatch) -> list[UpConfig]:
    """LocalSystem and the measurement replaced: the UpConfig of each system the tuner would
    start, in order."""
    measured: list[UpConfig] = []

    class System:  # kvmesh.cli.up.LocalSystem, not started
        model_dir, endpoint = MODEL, "127.0.0.1:1"

        def __init__(self, config: UpConfig) -> None:
            measured.append(config)

        def __enter__(self) -> System:
            return self

        def __exit__(self, *exc: object) -> None:
            pass

    async def measure(args: Any, target: str, name: str = "") -> dict[str, Any]:
        return dict(SUMMARY)

    monkeypatch.setattr("kvmesh.cli.up.LocalSystem", System)
    monkeypatch.setattr(tune, "measure", measure)
    return measured


@pytest.mark.parametrize("mode", ["colocated", "disaggregated"])
def test_recommended_command_starts_the_measured_system(
    mode: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    measured = stand_ins(monkeypatch)
    for name in ("KVMESH_NUM_THREADS", "KVMESH_MAX_NUM_BATCHED_TOKENS",
                 "KVMESH_LONG_PREFILL_TOKEN_THRESHOLD", "KVMESH_SCHEDULING_POLICY"):  # fmt: skip
        monkeypatch.delenv(name, raising=False)
    argv = ["tune", "chunked-prefill", "--slo-itl-p99", "100", "--model", MODEL,
            "--embedded", mode, "--threads", "1", "--budgets", "64", "--chunks", "32",
            "--policies", "prefill-first", "--no-progress", "--plot",
            str(tmp_path / "t.png")]  # fmt: skip
    assert main(argv) == 0
    line = next(w for w in capsys.readouterr().out.splitlines() if "kvmesh up" in w)
    words = shlex.split(line.strip())
    assert words[:2] == ["kvmesh", "up"]
    args = build_parser().parse_args(words[1:])
    config = config_from_args(args)
    (system,) = measured
    assert config.roles() == system.roles(), line
    assert config.threads == system.threads == 1, line
    engine = worker_engine_values(args)
    assert (engine["max_num_batched_tokens"], engine["long_prefill_token_threshold"],
            engine["scheduling_policy"]) == (64, 32, "prefill-first")  # fmt: skip


def test_worker_args_do_not_override_the_setting_a_row_is_named_for(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Later flags win in `kvmesh serve`: a swept flag in --worker-args must not replace the
    setting's own in every measured system."""
    measured = stand_ins(monkeypatch)
    argv = ["tune", "chunked-prefill", "--slo-itl-p99", "100", "--model", MODEL,
            "--budgets", "64,128", "--chunks", "none", "--policies", "decode-first",
            "--worker-args", "--max-num-batched-tokens 999 --num-kv-blocks 77",
            "--no-progress", "--json", "--plot", str(tmp_path / "t.png")]  # fmt: skip
    assert main(argv) == 0
    capsys.readouterr()
    budgets = []
    for config in measured:  # a worker's engine flags, as `kvmesh up` passes them on
        engine = worker_engine_values(build_parser().parse_args(["up", *config.worker_args]))
        assert engine["num_kv_blocks"] == 77
        budgets.append(engine["max_num_batched_tokens"])
    assert budgets == [64, 128]


def test_tune_refuses_the_tokenizer_flag_it_would_ignore(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The tuner sends token ids (a trace's text as text): `--tokenizer` is `bench serve`'s
    alone, and given to `tune` it is refused by name (before, it was accepted and ignored)."""
    argv = ["tune", "chunked-prefill", "--slo-itl-p99", "100", "--tokenizer", "/nonexistent"]
    with pytest.raises(SystemExit) as refused:
        build_parser().parse_args(argv)
    assert refused.value.code == 2
    assert "unrecognized arguments: --tokenizer" in capsys.readouterr().err
    bench = build_parser().parse_args(["bench", "serve", "--tokenizer", "/nonexistent"])
    assert bench.tokenizer == "/nonexistent"
