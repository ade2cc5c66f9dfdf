"""`kvmesh bench serve` and `kvmesh tune chunked-prefill` in their smoke modes: a few tiny
requests against the shared disaggregated system over gRPC, against a colocated system's
OpenAI-compatible HTTP door (completions and chat), and a two-setting tuner sweep on embedded
systems; the exit status of a sweep one of whose runs failed, against a scripted gRPC server."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import pytest
from sys_harness import local_system

from kvmesh.cli.main import main
from kvmesh.cli.up import LocalSystem
from kvmesh.loadgen import workloads
from kvmesh.v1 import generation_pb2, generation_pb2_grpc

PNG = b"\x89PNG\r\n\x1a\n"
W1_SMOKE = ["--workload", "w1", "--num-requests", "4", "--scale", "0.05", "--no-progress"]
W4_SMOKE = ["--workload", "w4", "--scale", "0.03", "--w4-steady", "3", "--w4-long", "2",
            "--w4-interval", "0.1", "--no-progress"]  # fmt: skip
SUMMARY_KEYS = {"requests", "completed", "failed", "duration_s", "input_tokens", "output_tokens",
                "request_throughput", "output_throughput", "total_token_throughput", "goodput",
                "good_requests", "goodput_output_throughput", "slo", "ttft_ms", "tpot_ms",
                "itl_ms", "e2e_ms"}  # fmt: skip


@pytest.fixture(scope="module")
def http_system(tiny_model: str) -> Iterator[LocalSystem]:
    with local_system(model=tiny_model, http_port=0, colocated=1, prefill=0, decode=0) as (
        started,
        _,
    ):
        yield started


@pytest.fixture(scope="module")
def system(shm_system: tuple[LocalSystem, str]) -> LocalSystem:
    return shm_system[0]


@pytest.fixture(scope="module")
def model() -> str:
    from kvmesh.models.tiny import tiny_model_path

    return str(tiny_model_path())


def run_json(capsys: pytest.CaptureFixture[str], argv: list[str], rc: int = 0) -> Any:
    assert main(argv) == rc
    return json.loads(capsys.readouterr().out)


def check_summary(s: dict[str, Any], expected_tokens: int, requests: int) -> None:
    """Counts match the workload, percentiles are ordered, goodput never exceeds throughput."""
    assert set(s) >= SUMMARY_KEYS
    assert s["requests"] == s["completed"] == requests and s["failed"] == 0
    assert s["output_tokens"] == s["expected_output_tokens"] == expected_tokens
    assert s["good_requests"] <= s["completed"]
    assert s["goodput"] <= s["request_throughput"]
    assert s["goodput_output_throughput"] <= s["output_throughput"]
    for name in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        d = s[name]
        assert 0 <= d["p50"] <= d["p90"] <= d["p99"], (name, d)
    assert s["ttft_ms"]["p50"] <= s["e2e_ms"]["p50"]
    assert s["request_throughput"] == pytest.approx(requests / s["duration_s"], rel=0.01)


def test_grpc_rate_sweep_reports_consistent_metrics_and_plots(
    system: LocalSystem, model: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    result = run_json(capsys, ["bench", "serve", "--target", system.endpoint, "--model",
                               model, *W1_SMOKE, "--rates", "20,40", "--arrival", "fixed",
                               "--slo-ttft-ms", "60000", "--slo-tpot-ms", "60000", "--json",
                               "--plot", str(tmp_path)])  # fmt: skip
    requests = workloads.build("w1", 1024, 4, 0, 0.05)
    expected = sum(r.output_len for r in requests)
    assert result["backend"] == "grpc" and [r["rate"] for r in result["runs"]] == [20, 40]
    for run in result["runs"]:
        s = run["summary"]
        check_summary(s, expected, 4)
        assert s["input_tokens"] == sum(r.prompt_len for r in requests)
        assert s["good_requests"] == 4 and s["goodput"] == s["request_throughput"]  # loose SLOs
        assert len(run["samples"]["ttft_ms"]) == 4
        assert len(run["samples"]["itl_ms"]) <= expected - 4  # at most one gap per later token
    for name in ("latency_cdf.png", "rate_sweep.png"):
        data = (tmp_path / name).read_bytes()
        assert data.startswith(PNG) and len(data) > 5000


def test_http_door_completions_and_chat_with_an_unmeetable_slo(
    http_system: LocalSystem, tiny_model: str, capsys: pytest.CaptureFixture[str]
) -> None:
    base = ["bench", "serve", "--base-url", f"{http_system.http_url}/v1", "--model", tiny_model]
    w4 = run_json(capsys, [*base, *W4_SMOKE, "--slo-itl-ms", "60000", "--json"])
    shape = workloads.W4Shape(steady=3, long=2, interval=0.1).scaled(0.03)
    expected = 3 * shape.steady_output + 2 * shape.long_output
    check_summary(w4["runs"][0]["summary"], expected, 5)
    groups = w4["runs"][0]["groups"]
    assert groups["steady"]["completed"] == 3 and groups["long"]["completed"] == 2
    assert groups["long"]["input_tokens"] == 2 * shape.long_prompt
    chat = run_json(capsys, [*base, *W1_SMOKE, "--endpoint", "chat", "--concurrency", "2",
                             "--slo-ttft-ms", "0.001", "--json"])  # fmt: skip
    s = chat["runs"][0]["summary"]
    assert chat["runs"][0]["concurrency"] == 2 and s["completed"] == 4 and s["failed"] == 0
    assert s["good_requests"] == 0 and s["goodput"] == 0.0 < s["request_throughput"]
    assert s["output_tokens"] == s["expected_output_tokens"]


def test_saved_results_plot_side_by_side(
    system: LocalSystem,
    http_system: LocalSystem,
    tiny_model: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    files = []
    for label, door in (("grpc", ["--target", system.endpoint]),
                        ("http", ["--base-url", f"{http_system.http_url}/v1"])):  # fmt: skip
        out = tmp_path / f"{label}.json"
        assert main(["bench", "serve", *door, "--model", tiny_model, *W1_SMOKE, "--rates", "30,60",
                     "--label", label, "--json-out", str(out)]) == 0  # fmt: skip
        files.append(str(out))
    capsys.readouterr()
    merged = run_json(capsys, ["bench", "serve", "--from-json", *files, "--json", "--plot",
                               str(tmp_path / "plots")])  # fmt: skip
    assert [r["label"] for r in merged] == ["grpc", "http"]
    assert (tmp_path / "plots" / "rate_sweep.png").read_bytes().startswith(PNG)


def test_bad_input_is_refused_naming_the_flag(
    system: LocalSystem, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["bench", "serve", "--target", system.endpoint, "--no-progress"]
    assert main([*argv, "--workload", "trace"]) == 2
    assert "--trace" in capsys.readouterr().err
    assert main([*argv, "--base-url", "http://127.0.0.1:1/v1"]) == 2
    assert "not both" in capsys.readouterr().err
    assert main([*argv, "--request-rate", "0"]) == 2
    assert "--request-rate" in capsys.readouterr().err
    assert main(["bench", "serve", "--model", "/nonexistent", "--no-progress"]) == 2  # embedded
    assert "model: '/nonexistent'" in capsys.readouterr().err
    tune = ["tune", "chunked-prefill", "--slo-itl-p99", "100", "--no-progress"]
    assert main([*tune, "--policies", "fastest"]) == 2
    assert "--policies" in capsys.readouterr().err


def test_tuner_on_a_running_system_reports_its_slo_verdict(
    system: LocalSystem, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["tune", "chunked-prefill", "--target", system.endpoint, *W4_SMOKE, "--json",
            "--plot", str(tmp_path / "t.png")]  # fmt: skip
    loose = run_json(capsys, [*argv, "--slo-itl-p99", "60000"])
    assert [r["name"] for r in loose["rows"]] == ["running system"]
    assert loose["recommended"]["name"] == "running system"
    strict = run_json(capsys, [*argv, "--slo-itl-p99", "0.0001"], rc=1)
    assert strict["recommended"] is None and not strict["rows"][0]["meets_slo"]
    assert (tmp_path / "t.png").read_bytes().startswith(PNG)


def test_tuner_sweeps_embedded_systems_and_recommends_a_setting_it_measured(
    model: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    plot = tmp_path / "tune.png"
    slo = 60000.0
    report = run_json(capsys, ["tune", "chunked-prefill", "--model", model,
                               "--slo-itl-p99", str(slo), "--budgets", "16,64", "--chunks", "none",
                               "--policies", "decode-first", *W4_SMOKE, "--json",
                               "--plot", str(plot)])  # fmt: skip
    rows = report["rows"]
    assert [r["name"] for r in rows] == ["16/-/df", "64/-/df"]
    best = report["recommended"]
    assert best in rows and best["meets_slo"] and best["itl_p99_ms"] <= slo
    feasible = [r for r in rows if r["meets_slo"]]
    assert best["goodput_output_throughput"] == max(
        r["goodput_output_throughput"] for r in feasible
    )
    assert best["flags"][:2] == ["--max-num-batched-tokens", str(best["budget"])]
    assert all(r["completed"] == 5 and r["failed"] == 0 for r in rows)
    assert plot.read_bytes().startswith(PNG)


class FailsTheFirstRun(generation_pb2_grpc.GenerationServiceServicer):
    """A scripted GenerationService: Generate calls 2 and 3 (the first run of 2 requests after
    the warm-up) fail INVALID_ARGUMENT, the others stream `max_tokens` tokens."""

    def __init__(self) -> None:
        self.calls = 0
        self.lock = threading.Lock()

    def GetModelInfo(self, request: Any, context: grpc.ServicerContext) -> Any:
        return generation_pb2.ModelInfo(model_name="scripted", vocab_size=1000)

    def Generate(self, request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
        with self.lock:
            self.calls += 1
            call = self.calls
        if call in (2, 3):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "scripted failure")
        n = request.sampling.max_tokens
        for i in range(n):
            chunk = generation_pb2.GenerateResponse(request_id=request.request_id, token_ids=[5])
            if i == n - 1:
                chunk.finish_reason = generation_pb2.FINISH_REASON_LENGTH
                chunk.usage.prompt_tokens = len(request.token_ids.ids)
                chunk.usage.completion_tokens = n
            yield chunk


@pytest.fixture
def fails_the_first_run() -> Iterator[tuple[FailsTheFirstRun, str]]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    servicer = FailsTheFirstRun()
    generation_pb2_grpc.add_GenerationServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield servicer, f"127.0.0.1:{port}"
    server.stop(None)


def test_a_sweep_exits_1_when_any_run_completed_no_request(
    fails_the_first_run: tuple[FailsTheFirstRun, str],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Every run of a sweep counts, not only the last (live and with --from-json alike)."""
    servicer, address = fails_the_first_run
    saved = tmp_path / "sweep.json"
    result = run_json(capsys, ["bench", "serve", "--target", address, "--rates", "200,200",
                               "--num-requests", "2", "--scale", "0.02", "--no-progress",
                               "--json", "--json-out", str(saved)], rc=1)  # fmt: skip
    assert servicer.calls == 5  # the warm-up and 2 runs of 2
    assert [r["summary"]["completed"] for r in result["runs"]] == [0, 2]
    assert main(["bench", "serve", "--from-json", str(saved)]) == 1
