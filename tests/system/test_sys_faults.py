"""Fault suite: kill -9 and SIGSTOP of each role of a 2 + 2 `kvmesh up` system with restarts.

Each case checks: the streams served by the failed worker end with a status (never at their
deadline), every other stream completes (zero collateral loss), the supervisor restarts what
died or wedged, no KV block and no ledger entry is left, and the system serves again.
`KVMESH_FAULT_REPORT=FILE` records what each case measured (see fault_harness).
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import grpc
import pytest
from fault_harness import (
    Stream,
    busiest,
    first_success,
    kill9,
    report,
    running,
    sigcont,
    sigstop,
    spread_streams,
    start_stream,
    wait_for_workers,
    worker_of,
)
from sys_harness import idle, live_workers, local_system, used_blocks, wait_until

from kvmesh.cli.restarts import RestartPolicy
from kvmesh.cli.up import LocalSystem, Worker
from kvmesh.client import Client
from kvmesh.security.credentials import bearer_metadata
from kvmesh.v1 import worker_pb2, worker_pb2_grpc

pytestmark = pytest.mark.slow
POLICY = RestartPolicy(backoff_initial=0.5, backoff_max=2.0, crash_loop_limit=3,
                       stable_seconds=5.0, wedged_seconds=5.0, probe_timeout=0.5,
                       startup_seconds=120.0)  # fmt: skip
ENDED = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.ABORTED}
LEASE_BOUND = 10.0  # worker lease (2 s) + reaper + margin: a lost stream ends within it
RESTART_BOUND = 90.0  # backoff + a worker's start on a loaded 2-core machine
STREAM_SECONDS = 9.0  # how long each stream of a case lasts when nothing fails
DRAIN_CAP = 1.5  # the control plane's --drain-seconds
DECODE_BLOCKS = 1024  # the last flag wins over the harness's 256
MAX_STREAM_TOKENS = 2000  # four such streams fit one decode worker (no preemption)


@pytest.fixture(scope="module")
def system() -> Iterator[tuple[LocalSystem, str]]:
    with local_system(transfer_backend="shm", prefill=2, decode=2, restart=POLICY,
                      drain_seconds=DRAIN_CAP,
                      role_args={"decode": ("--num-kv-blocks", str(DECODE_BLOCKS))},
                      ) as started:  # fmt: skip
        yield started


@pytest.fixture(scope="module")
def stream_tokens(system: tuple[LocalSystem, str]) -> int:
    """max_tokens for streams lasting about STREAM_SECONDS, four at once, on this machine."""
    _, endpoint = system
    streams = [start_stream(endpoint, i, 48) for i in range(4)]
    start = time.monotonic()
    for stream in streams:
        stream.join(60)
        assert stream.error is None, stream.error
    per_token = (time.monotonic() - start) / 48
    return max(64, min(MAX_STREAM_TOKENS, int(STREAM_SECONDS / per_token)))


@pytest.fixture(autouse=True)
def healthy(system: tuple[LocalSystem, str]) -> None:
    """Each case starts from a full, idle, serving system (whatever the previous one left)."""
    recovered(*system)


def finish(streams: list[Stream], seconds: float) -> None:
    for stream in streams:
        stream.join(seconds)


def assert_only_the_victims_lost(
    streams: list[Stream], victims: set[str], struck: float = 0.0, tokens: int = 0
) -> int:
    """Streams still running on `victims` when they were struck ended UNAVAILABLE/ABORTED,
    unless all their `tokens` had left the worker before the fault (the client read the end
    just after it); every other one completed; returns how many were lost."""
    for stream in streams:
        if stream.worker in victims and stream.ended_at > struck:
            complete = stream.error is None and stream.tokens == tokens
            assert complete or (stream.error is not None and stream.error.code in ENDED), stream
        else:
            assert stream.error is None, f"collateral loss on {stream.worker}: {stream.error}"
    return sum(stream.error is not None for stream in streams)


def settled(local: LocalSystem) -> bool:
    """Every child slot holds a live, ready process and no restart is pending."""
    keeper = local.keeper
    assert keeper is not None
    pending = any(w.restart_at is not None or w.ready_at is None for w in keeper.watches.values())
    return not pending and all(w.child.alive() and w.ready for w in local.workers)


def replaced(local: LocalSystem, old: Worker) -> None:
    """Wait until the supervisor started `old`'s slot again and the new process is ready."""
    name = old.child.name
    wait_until(lambda: local.worker(name) is not old and bool(worker_of(local, name).ready),
               RESTART_BOUND, f"{name} restarted")  # fmt: skip


def recovered(local: LocalSystem, endpoint: str) -> None:
    """Back to 2 + 2 ready processes the control plane counts live, nothing held anywhere,
    and a request succeeds."""
    wait_until(lambda: settled(local), RESTART_BOUND, "every child up and ready")
    wait_for_workers(local, "decode", 2, RESTART_BOUND)
    wait_for_workers(local, "prefill", 2, RESTART_BOUND)
    wait_until(lambda: idle(local), LEASE_BOUND, "no blocks and no ledger entry left")
    first_success(endpoint, 30)


def test_release_of_a_decoding_request_ends_its_stream_at_once(
    system: tuple[LocalSystem, str], stream_tokens: int
) -> None:
    """DecodeService.Release of a request mid-stream: ABORTED within a second, not at the
    deadline, and its blocks are free."""
    local, endpoint = system
    stream = start_stream(endpoint, 0, stream_tokens, request_id="released-mid-stream")
    assert stream.first.wait(60)
    holder = max(running(local).items(), key=lambda item: item[1])[0]
    address = worker_of(local, holder).ready["address"]
    with grpc.insecure_channel(address) as channel:
        stub = worker_pb2_grpc.DecodeServiceStub(channel)
        released_at = time.monotonic()
        request = worker_pb2.ReleaseRequest(request_id="released-mid-stream", reason="operator")
        token = bearer_metadata(local.env["KVMESH_CLUSTER_TOKEN"])  # an internal port
        assert stub.Release(request, timeout=5, metadata=token).released
    stream.join(5)
    assert stream.error is not None and stream.error.code == grpc.StatusCode.ABORTED
    assert "released" in stream.error.message
    ended = stream.ended_at - released_at
    assert ended < 1.0
    wait_until(lambda: idle(local), LEASE_BOUND, "released blocks are free")
    report("decode Release mid-stream", lost=1, collateral=0, leaked=0, stream_end_s=ended)


@pytest.mark.parametrize("fault", ["kill -9", "SIGSTOP"])
def test_decode_worker_fault_fails_only_its_streams(
    system: tuple[LocalSystem, str], stream_tokens: int, fault: str
) -> None:
    local, endpoint = system
    streams = spread_streams(local, endpoint, 4, stream_tokens)
    victim_name = streams[-1].worker  # its newest stream is surely still running
    assert victim_name and {s.worker for s in streams} == {"decode-0", "decode-1"}, streams
    victim = worker_of(local, victim_name)
    struck = time.monotonic()
    if fault == "kill -9":
        kill9(local, victim)
    else:
        sigstop(victim)  # wedged: the supervisor kills it after POLICY.wedged_seconds
    outage = first_success(endpoint, 30)  # the other decode worker serves meanwhile
    finish([s for s in streams if s.worker == victim_name], LEASE_BOUND)
    victims_ended = max(s.ended_at for s in streams if s.worker == victim_name) - struck
    finish(streams, 60)
    lost = assert_only_the_victims_lost(streams, {victim_name}, struck, stream_tokens)
    assert lost >= 1
    assert live_workers(local, "decode") >= 1
    replaced(local, victim)
    recovered(local, endpoint)
    report(f"decode {fault}", lost=lost, collateral=0, leaked=0, outage_s=outage,
           victims_ended_s=victims_ended, recover_s=time.monotonic() - struck)  # fmt: skip


@pytest.mark.parametrize("fault", ["kill -9", "SIGSTOP"])
def test_prefill_worker_fault_after_its_transfers_loses_no_stream(
    system: tuple[LocalSystem, str], stream_tokens: int, fault: str
) -> None:
    local, endpoint = system
    streams = spread_streams(local, endpoint, 4, stream_tokens)
    victim = busiest(local, "prefill")  # it prefilled (some of) the streams
    struck = time.monotonic()
    if fault == "kill -9":
        kill9(local, victim)
        wait_for_workers(local, "prefill", 1, LEASE_BOUND)
    else:
        sigstop(victim)
        wait_for_workers(local, "prefill", 1, LEASE_BOUND)  # declared dead ...
        sigcont(victim)  # ... and back before the supervisor's wedge bound
    outage = first_success(endpoint, 30)
    finish(streams, 60)
    lost = assert_only_the_victims_lost(streams, set())
    assert lost == 0
    if fault == "kill -9":
        replaced(local, victim)
    recovered(local, endpoint)
    report(f"prefill {fault} (after transfer)", lost=0, collateral=0, leaked=0,
           outage_s=outage, recover_s=time.monotonic() - struck)  # fmt: skip


def test_both_decode_workers_killed_the_system_serves_again_after_restart(
    system: tuple[LocalSystem, str],
) -> None:
    """No redundancy left: the supervisor's restarts end the outage (lease + restart)."""
    local, endpoint = system
    struck = time.monotonic()
    for name in ("decode-0", "decode-1"):
        kill9(local, worker_of(local, name))
    outage = first_success(endpoint, RESTART_BOUND)
    recovered(local, endpoint)
    report("both decode workers kill -9", lost=0, collateral=0, leaked=0, outage_s=outage,
           recover_s=time.monotonic() - struck)  # fmt: skip


@pytest.mark.parametrize("fault", ["kill -9", "SIGSTOP"])
def test_control_plane_fault_is_restarted_and_workers_reregister(
    system: tuple[LocalSystem, str], stream_tokens: int, fault: str
) -> None:
    local, endpoint = system
    streams = spread_streams(local, endpoint, 2, stream_tokens)
    assert local.control is not None
    struck = time.monotonic()
    if fault == "kill -9":
        local.supervisor.kill(local.control)
    else:
        sigstop_control(local)
    finish(streams, LEASE_BOUND + POLICY.wedged_seconds)
    ended = [s for s in streams if s.ended_at > struck]  # it carried every running stream
    assert ended and all(s.error is not None and s.error.code in ENDED for s in ended), streams
    first_success(endpoint, RESTART_BOUND)
    outage = time.monotonic() - struck  # its clients had no front door until now
    recovered(local, endpoint)
    report(f"control plane {fault}", lost=len(ended), collateral=0, leaked=0,
           outage_s=outage, recover_s=time.monotonic() - struck)  # fmt: skip


def sigstop_control(local: LocalSystem) -> None:
    import os
    import signal

    assert local.control is not None
    os.killpg(local.control.pid, signal.SIGSTOP)


def test_drain_lets_a_short_stream_finish_and_cuts_a_long_one_with_a_reason(
    system: tuple[LocalSystem, str], stream_tokens: int
) -> None:
    """SIGTERM to the control plane: a stream that fits the drain bound completes, one that
    cannot is cut with UNAVAILABLE "draining ... retry"; the supervisor starts it again."""
    local, endpoint = system
    short_tokens = max(8, int(stream_tokens * 0.3 / STREAM_SECONDS))  # about 0.3 s
    short = start_stream(endpoint, 0, short_tokens)
    long = start_stream(endpoint, 1, 2000)  # far longer than the cap
    assert short.first.wait(60) and long.first.wait(60)
    assert local.control is not None
    started = time.monotonic()
    local.supervisor.stop(local.control, grace=15.0)
    drained = time.monotonic() - started
    finish([short, long], 10)
    assert short.error is None and short.tokens == short_tokens
    assert long.error is not None and long.error.code == grpc.StatusCode.UNAVAILABLE
    assert "draining" in long.error.message and "retry" in long.error.message
    assert drained < DRAIN_CAP + 3.0  # the drain cap plus the stop
    with Client(endpoint) as client:
        wait_until(client.serving, RESTART_BOUND, "the control plane is back")
    recovered(local, endpoint)
    assert not any(used_blocks(local).values())
    report("control plane drain (SIGTERM)", lost=0, cut=1, collateral=0, leaked=0, drain_s=drained)
