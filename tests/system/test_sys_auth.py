"""A real `kvmesh up` with every door locked: a per-run cluster token on every internal port,
mutual TLS everywhere (a CA made in the test), API keys on the public door, KV over the gRPC
stream. The official `openai` client and kvmesh's Client get answers with a key and 401 /
UNAUTHENTICATED without; every forged internal call (Register, Heartbeat, Prepare, Prefill,
Reserve, Decode, Release, the KV stream) is refused even over mutual TLS, and nothing changed.
The supervisor's health checks pass mutual TLS, and what it restarts comes back with the token,
the certificates and the same addresses."""

from __future__ import annotations

import json
import os
import ssl
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import openai
import pytest
from sys_harness import idle, live_workers, local_system, sample, wait_until

from kvmesh.cli.restarts import HealthProbe, RestartPolicy
from kvmesh.cli.up import LocalSystem, kvmesh_argv
from kvmesh.client import Client, KvmeshError, channel_credentials
from kvmesh.v1 import (
    generation_pb2,
    kv_transfer_pb2,
    kv_transfer_pb2_grpc,
    worker_pb2,
    worker_pb2_grpc,
)
from tests.pki import Pki, make_pki

KEY = "system-test-api-key-0123456789"
UNAUTHENTICATED = grpc.StatusCode.UNAUTHENTICATED
WRONG = [(), (("authorization", "Bearer forged-cluster-token-0123456789"),)]
RESTARTS = RestartPolicy(backoff_initial=0.5, backoff_max=2.0, wedged_seconds=5.0,
                         startup_seconds=120.0)  # fmt: skip
RESTART_BOUND = 90.0  # backoff + a process's start on a loaded machine


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def key_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    keys = tmp_path_factory.mktemp("keys") / "api-keys"
    keys.write_text(f"# front-door keys\n{KEY}\n")
    keys.chmod(0o600)
    return keys


@pytest.fixture(scope="module")
def system(pki: Pki, key_file: Path) -> Iterator[LocalSystem]:
    keys = key_file
    tls = {"tls_cert": pki.cert, "tls_key": pki.key, "tls_ca": pki.ca}
    with local_system(transfer_backend="grpc", http_port=0, api_key_file=str(keys),
                      restart=RESTARTS, **tls) as (started, _):  # fmt: skip
        yield started


def client(system: LocalSystem, pki: Pki, **kwargs: Any) -> Client:
    return Client(system.endpoint, timeout=60, ca=pki.ca, cert=pki.cert, key=pki.key, **kwargs)


def test_token_reaches_children_only_through_their_environment(system: LocalSystem) -> None:
    token = system.env["KVMESH_CLUSTER_TOKEN"]
    assert len(token) >= 40
    children = [system.control, *(w.child for w in system.workers)]
    for child in children:
        assert child is not None
        cmdline = Path(f"/proc/{child.pid}/cmdline").read_bytes()
        assert token.encode() not in cmdline


def test_grpc_client_needs_the_api_key(system: LocalSystem, pki: Pki) -> None:
    with client(system, pki, api_key=KEY) as good:
        assert good.complete([5, 9, 2, 44], max_tokens=4, temperature=0.0).token_ids
    for key in (None, "wrong-system-key-0123456789"):
        with client(system, pki, api_key=key) as bad, pytest.raises(KvmeshError) as caught:
            bad.complete("hello", max_tokens=4)
        assert caught.value.code == UNAUTHENTICATED
    assert idle(system)


def test_openai_client_streams_with_the_key_and_gets_401_without(
    system: LocalSystem, pki: Pki
) -> None:
    context = ssl.create_default_context(cafile=pki.ca)

    def api(key: str) -> openai.OpenAI:
        http = openai.DefaultHttpxClient(verify=context)
        return openai.OpenAI(base_url=f"{system.http_url}/v1", api_key=key, max_retries=0,
                             http_client=http)  # fmt: skip

    assert system.http_url.startswith("https://")
    stream = api(KEY).completions.create(
        model=Path(system.model_dir).name, prompt=[5, 9, 2, 44], max_tokens=4, stream=True,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    finished = [c.choices[0].finish_reason for c in stream if c.choices]
    assert finished[-1] == "length"
    with pytest.raises(openai.AuthenticationError) as caught:
        api("wrong-system-key-0123456789").models.list()
    assert caught.value.status_code == 401 and caught.value.code == "invalid_api_key"


def forged_calls(system: LocalSystem, pki: Pki) -> list[tuple[str, str, Callable[..., Any]]]:
    """(target, name, call(metadata)) for every internal method; each channel is mutual TLS
    with a valid cluster certificate, so only the missing token stops them."""
    credentials = channel_credentials(ca=pki.ca, cert=pki.cert, key=pki.key)
    by_role = {w.role: w.ready for w in system.workers}
    prefill_address = by_role["prefill"]["address"]
    decode_address = by_role["decode"]["address"]
    kv_address = by_role["decode"]["transfer_endpoints"]["grpc"]
    targets = (system.internal_endpoint, prefill_address, decode_address, kv_address)
    channels = {a: grpc.secure_channel(a, credentials) for a in targets}
    control = worker_pb2_grpc.ControlServiceStub(channels[system.internal_endpoint])
    prefill = worker_pb2_grpc.PrefillServiceStub(channels[prefill_address])
    decode = worker_pb2_grpc.DecodeServiceStub(channels[decode_address])
    kv = kv_transfer_pb2_grpc.KVTransferServiceStub(channels[kv_address])
    engine = worker_pb2.EngineRequest(request_id="forged", prompt_ids=list(range(40)))
    prompt = generation_pb2.GenerateRequest(request_id="forged", text="leak me other prompts")
    takeover = worker_pb2.WorkerInfo(
        worker_id=by_role["decode"]["worker_id"], role=worker_pb2.WORKER_ROLE_DECODE,
        address="127.0.0.1:9", epoch=by_role["decode"]["epoch"] + 1,
        layout=worker_pb2.KVCacheLayout(block_size=16),
    )  # fmt: skip
    unary = [
        ("control", "Register", lambda md: control.Register(
            worker_pb2.RegisterRequest(worker=takeover), metadata=md, timeout=5)),
        ("control", "Heartbeat", lambda md: control.Heartbeat(
            worker_pb2.HeartbeatRequest(worker_id=takeover.worker_id, epoch=takeover.epoch),
            metadata=md, timeout=5)),
        ("prefill", "Prepare", lambda md: prefill.Prepare(
            worker_pb2.PrepareRequest(request=prompt), metadata=md, timeout=5)),
        ("prefill", "Prefill", lambda md: prefill.Prefill(
            worker_pb2.PrefillRequest(request=engine), metadata=md, timeout=5)),
        ("prefill", "Release", lambda md: prefill.Release(
            worker_pb2.ReleaseRequest(request_id="forged"), metadata=md, timeout=5)),
        ("decode", "Reserve", lambda md: decode.Reserve(
            worker_pb2.ReserveRequest(request=engine, generation=1, lease_seconds=30),
            metadata=md, timeout=5)),
        ("decode", "Decode", lambda md: list(decode.Decode(
            worker_pb2.DecodeRequest(request_id="forged"), metadata=md, timeout=5))),
        ("decode", "Release", lambda md: decode.Release(
            worker_pb2.ReleaseRequest(request_id="forged"), metadata=md, timeout=5)),
        ("kv", "Handshake", lambda md: kv.Handshake(
            kv_transfer_pb2.HandshakeRequest(layout=b"{}"), metadata=md, timeout=5)),
        ("kv", "PushBlocksUnary", lambda md: kv.PushBlocksUnary(
            kv_transfer_pb2.KVFrame(), metadata=md, timeout=5)),
    ]  # fmt: skip
    return unary


def test_every_forged_internal_call_is_refused_and_changes_nothing(
    system: LocalSystem, pki: Pki
) -> None:
    refused = []
    for target, name, call in forged_calls(system, pki):
        for metadata in WRONG:
            with pytest.raises(grpc.RpcError) as caught:
                call(metadata)
            error: Any = caught.value
            assert error.code() == UNAUTHENTICATED, f"{target}.{name}: {error}"
            assert "cluster token" in error.details()
            refused.append(f"{target}.{name}")
    assert len(refused) == 20
    for worker in system.workers:  # 3 worker methods x 2 forgeries on each worker's own port
        assert sample(worker.ready["metrics_address"], "kvmesh_auth_refused_total") == 6
    assert idle(system)  # no block held anywhere, no ledger entry
    assert live_workers(system, "decode") == 1 and live_workers(system, "prefill") == 1
    with client(system, pki, api_key=KEY) as good:  # the genuine cluster still serves
        assert good.complete([5, 9, 2, 44, 17], max_tokens=6, temperature=0.0).token_ids
    assert all(w.child.alive() for w in system.workers)


def test_kvmesh_generate_takes_the_key_and_certificates(
    system: LocalSystem, pki: Pki, key_file: Path
) -> None:
    base = [*kvmesh_argv(), "generate", "--target", system.endpoint, "--prompt-ids", "5,9,2",
            "--max-tokens", "3", "--ignore-eos", "--json", "--tls-ca", pki.ca]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "KVMESH_API_KEY"}
    good = subprocess.run([*base, "--api-key-file", str(key_file)], capture_output=True,
                          text=True, timeout=120, env=env)  # fmt: skip
    assert good.returncode == 0, good.stderr
    assert len(json.loads(good.stdout.splitlines()[-1])["token_ids"]) == 3
    bad = subprocess.run(base, capture_output=True, text=True, timeout=120, env=env)
    assert bad.returncode == 1 and "UNAUTHENTICATED: missing API key" in bad.stderr


def test_supervisor_probes_over_mutual_tls_and_restarts_with_token_and_certificates(
    system: LocalSystem, pki: Pki
) -> None:
    """Health checks pass mutual TLS (no healthy child is taken for wedged); a killed control
    plane comes back on its public and internal ports and the workers re-register with the
    token; a killed decode worker comes back, registers and serves. Runs last: it restarts."""
    keeper = system.keeper
    assert keeper is not None
    addresses = [system.endpoint, *(w.ready["address"] for w in system.workers)]
    assert [keeper.probe.check(a) for a in addresses] == [True] * len(addresses)
    plaintext = HealthProbe(timeout=1.0)
    try:  # the worker ports require a client certificate: a plaintext probe gets no answer
        assert [plaintext.check(w.ready["address"]) for w in system.workers] == [None, None]
    finally:
        plaintext.close()
    assert all(w.restarts == 0 and w.unhealthy_since is None for w in keeper.watches.values())
    public, internal, http = system.endpoint, system.internal_endpoint, system.http_url

    old_control = system.control
    assert old_control is not None
    system.supervisor.kill(old_control)
    wait_until(lambda: keeper.watches["control"].restarts == 1 and system.control is not None
               and system.control is not old_control and system.control.alive(),
               RESTART_BOUND, "control plane restarted")  # fmt: skip
    assert (system.endpoint, system.internal_endpoint, system.http_url) == (public, internal, http)
    wait_until(lambda: _live(system, "decode") == 1 and _live(system, "prefill") == 1,
               RESTART_BOUND, "workers re-registered with the restarted control plane")  # fmt: skip

    decode = next(w for w in system.workers if w.role == "decode")
    system.supervisor.kill(decode.child)
    name = decode.child.name
    wait_until(lambda: _restarted(system, name, decode.child.pid), RESTART_BOUND,
               f"{name} restarted")  # fmt: skip
    wait_until(lambda: _live(system, "decode") == 1, RESTART_BOUND, f"{name} registered")
    with client(system, pki, api_key=KEY) as good:
        assert good.complete([5, 9, 2, 44], max_tokens=4, temperature=0.0).token_ids
    restarted = system.worker(name)
    assert restarted is not None and keeper.probe.check(restarted.ready["address"]) is True
    assert {n: w.restarts for n, w in keeper.watches.items() if w.restarts} == {
        "control": 1,
        name: 1,
    }


def _live(system: LocalSystem, role: str) -> float:
    try:
        return live_workers(system, role)
    except OSError:  # the control plane's metrics port is not up yet
        return -1.0


def _restarted(system: LocalSystem, name: str, old_pid: int) -> bool:
    worker = system.worker(name)
    return worker is not None and worker.child.pid != old_pid and bool(worker.ready)
