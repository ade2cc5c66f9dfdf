"""`kvmesh up`: the whole system on localhost, one process per role, until Ctrl-C.

Start order: control plane (its "listening on HOST:PORT" line, after its "OpenAI-compatible API
on URL/v1" line when the HTTP door is on and its "internal ControlService on HOST:PORT" line,
the address workers register with), then every worker (its
`KVMESH_READY {json}` line), then the front door's health for GenerationService must read
SERVING, all before `--startup-timeout`. Stop order: the control plane first (it drains in-flight
requests, bounded), then the workers (SIGTERM, SIGKILL after a bound). Children run under
`kvmesh.cli.supervisor`, so none outlives `kvmesh up`, even when it is killed with SIGKILL.
With a restart policy (`kvmesh up` has one unless `--no-restart`), a background thread
restarts dead or wedged children with backoff (`kvmesh.cli.restarts`).
`LocalSystem` is the same thing as a context manager for tests and benchmarks.

Security: every run makes a fresh random cluster token and hands it to the children in their
environment (`KVMESH_CLUSTER_TOKEN`, never on a command line), so every internal port (the
control plane's internal door, every worker port, the gRPC KV stream) refuses calls without it.
`--tls-cert/--tls-key/--tls-ca` go to every child; `--api-key-file` to the control plane.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import signal
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc

from kvmesh.cli.restarts import POLL_SECONDS, Keeper, RestartPolicy
from kvmesh.cli.supervisor import Child, ChildFailed, Supervisor
from kvmesh.client import KvmeshError
from kvmesh.security.credentials import new_token
from kvmesh.security.tls import TlsConfig
from kvmesh.service.engine_flags import (
    add_engine_flags,
    engine_argv,
    engine_flags,
    engine_values,
    env_values,
    validate,
)
from kvmesh.v1.transfer import DEFAULT_BACKEND, WORKER_BACKENDS

CONTROL_READY = re.compile(r"listening on (\S+)")
INTERNAL_READY = re.compile(r"internal ControlService on (\S+)")
INTERNAL_HOST = "127.0.0.1"  # every worker runs on this host: the internal door stays local
METRICS_READY = re.compile(r"control plane metrics on (\S+)")
HTTP_READY = re.compile(r"OpenAI-compatible API on (\S+)/v1")
WORKER_READY = re.compile(r"KVMESH_READY (\{.*\})")
UP_OWN_FIELDS = ("num_threads",)  # `--threads` also sets OMP_NUM_THREADS
DEMO_PROMPT = "What is the capital of France?"


@dataclass(frozen=True)
class UpConfig:
    """What to start. `model=None` uses the embedded default model."""

    model: str | None = None
    prefill: int = 1
    decode: int = 1
    colocated: int = 0
    host: str = "127.0.0.1"
    port: int = 50051  # 0 picks a free port
    internal_port: int = 0  # the control plane's internal door (0 picks a free port)
    http_port: int | None = None  # OpenAI-compatible HTTP API (0 picks a free port; None: off)
    transfer_backend: str = DEFAULT_BACKEND
    threads: int | None = None  # torch threads per worker
    startup_timeout: float = 180.0
    drain_seconds: float = 30.0  # the control plane's drain cap (its bound is sized per request)
    restart: RestartPolicy | None = None  # restart dead or wedged children (None: never)
    control_args: tuple[str, ...] = ()
    worker_args: tuple[str, ...] = ()  # passed to every worker
    role_args: Mapping[str, tuple[str, ...]] = field(default_factory=dict)  # role -> extra args
    tls_cert: str | None = None  # TLS on every port (with tls_key); mutual TLS with tls_ca
    tls_key: str | None = None
    tls_ca: str | None = None
    api_key_file: str | None = None  # API keys the public door requires

    def __post_init__(self) -> None:
        if min(self.prefill, self.decode, self.colocated) < 0:
            raise ValueError("--prefill, --decode and --colocated must be >= 0")
        if self.colocated == 0 and (self.prefill == 0 or self.decode == 0):
            raise ValueError("need at least one prefill and one decode worker, or --colocated")

    def tls_args(self) -> list[str]:
        pairs = (("--tls-cert", self.tls_cert), ("--tls-key", self.tls_key),
                 ("--tls-ca", self.tls_ca))  # fmt: skip
        return [word for flag, value in pairs if value for word in (flag, value)]

    def client_options(self) -> dict[str, Any]:
        """Client keywords that reach this system's front door (TLS, the first API key): the
        keys are resolved as the control plane resolves them (`api_key_file`, else
        KVMESH_API_KEY_FILE, else KVMESH_API_KEY; it inherits this environment)."""
        from kvmesh.security.credentials import api_keys

        key = next(iter(api_keys(self.api_key_file, os.environ)), None)
        tls = self.tls_cert is not None
        return {"tls": tls, "ca": self.tls_ca, "cert": self.tls_cert if self.tls_ca else None,
                "key": self.tls_key if self.tls_ca else None, "api_key": key}  # fmt: skip

    def probe_credentials(self) -> grpc.ChannelCredentials | None:
        """Channel credentials of health checks on every child's port (None: plaintext):
        TLS verifying against `tls_ca` and presenting the node certificate, which the internal
        ports require under mutual TLS."""
        if self.tls_cert is None:
            return None
        return TlsConfig(cert=self.tls_cert, key=self.tls_key, ca=self.tls_ca).channel_credentials()

    def roles(self) -> list[str]:
        return (
            ["prefill"] * self.prefill + ["decode"] * self.decode + (["colocated"] * self.colocated)
        )

    def worker_threads(self) -> int:
        """Torch (and OpenMP) threads per worker: `threads`, else the cores this process may
        run on shared among the workers, at least 1. Workers that together ask for more
        threads than there are cores slow each other down: an OpenMP region waits for its
        slowest thread, and with disaggregation the prefill computes while the decode worker
        and the control plane are busy with the same request."""
        if self.threads is not None:
            return self.threads
        return max(1, usable_cores() // max(1, len(self.roles())))


def usable_cores() -> int:
    """The CPUs this process may run on (its affinity), else the machine's count."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # no sched_getaffinity (macOS)
        return os.cpu_count() or 1


@dataclass
class Worker:
    role: str
    child: Child
    ready: dict[str, Any] = field(default_factory=dict)  # the worker's KVMESH_READY payload


class LocalSystem:
    """Control plane + workers as local processes; `start()` returns the front door address."""

    def __init__(self, config: UpConfig, echo: bool = False) -> None:
        self.config = config
        self.supervisor = Supervisor(echo=echo, grace=5.0)
        # Fresh per run; reaches the children only through their environment.
        self.env = {"KVMESH_CLUSTER_TOKEN": new_token(), "KVMESH_CLUSTER_TOKEN_FILE": ""}
        self.endpoint = ""
        self.internal_endpoint = ""  # the control plane's internal door (workers' --control)
        self.http_url = ""  # http://HOST:PORT of the OpenAI-compatible API, when enabled
        self.control_metrics = ""  # HOST:PORT of the control plane's Prometheus endpoint
        self.model_dir = ""
        self.control: Child | None = None
        self.workers: list[Worker] = []
        self.keeper: Keeper | None = None

    def __enter__(self) -> LocalSystem:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> str:
        deadline = time.monotonic() + self.config.startup_timeout
        self.model_dir = resolve_model(self.config.model)
        self.start_control(deadline)
        for role in self.config.roles():
            self.start_worker(role)  # all load their model in parallel
        for worker in self.workers:
            self._wait_ready(worker, deadline)
        wait_serving(self.endpoint, deadline, **self.config.client_options())
        if self.config.restart is not None:
            self.start_keeping(self.config.restart)
        return self.endpoint

    def start_keeping(self, policy: RestartPolicy) -> Keeper:
        """Restart dead or wedged children from a background thread until `stop`."""
        self.keeper = Keeper(self, policy, credentials=self.config.probe_credentials())
        self.keeper.start()
        return self.keeper

    def start_control(self, deadline: float) -> str:
        """(Re)start the control plane; returns its address."""
        c = self.config
        argv = [*kvmesh_argv(), "serve", "control", "--host", c.host, "--port", str(c.port),
                "--internal-port", str(c.internal_port), "--internal-host", INTERNAL_HOST,
                "--transfer-backends", c.transfer_backend, "--drain-seconds",
                str(c.drain_seconds), "--metrics-port", self._metrics_port(), *c.tls_args(),
                *c.control_args]  # fmt: skip
        if c.api_key_file:
            argv += ["--api-key-file", c.api_key_file]
        if self.endpoint:  # a restart keeps the addresses clients and workers know
            argv[argv.index("--port") + 1] = self.endpoint.rsplit(":", 1)[1]
            argv[argv.index("--internal-port") + 1] = self.internal_endpoint.rsplit(":", 1)[1]
        if c.http_port is not None:  # a restart keeps the HTTP address too
            port = self.http_url.rsplit(":", 1)[1] if self.http_url else str(c.http_port)
            argv += ["--http-port", port]
        self.control = self.supervisor.start("control", argv, {**self.env, **role_env("control")})
        if c.http_port is not None:  # printed before the gRPC lines
            self.http_url = self.supervisor.wait_for(self.control, HTTP_READY, deadline).group(1)
        metrics = self.supervisor.wait_for(self.control, METRICS_READY, deadline)
        self.control_metrics = metrics.group(1)
        internal = self.supervisor.wait_for(self.control, INTERNAL_READY, deadline)
        self.internal_endpoint = internal.group(1)
        self.endpoint = self.supervisor.wait_for(self.control, CONTROL_READY, deadline).group(1)
        return self.endpoint

    def _metrics_port(self) -> str:
        """A free port at first (0), the same one on a restart."""
        return self.control_metrics.rsplit(":", 1)[1] if self.control_metrics else "0"

    def start_worker(
        self, role: str, deadline: float | None = None, name: str | None = None
    ) -> Worker:
        """Start one worker (a new slot, or the slot `name` again); with a deadline, also
        wait for its ready line."""
        c = self.config
        name = name or f"{role}-{sum(w.role == role for w in self.workers)}"
        argv = [*kvmesh_argv(), "serve", role, "--control", self.internal_endpoint,
                "--model", self.model_dir, "--host", c.host, "--port", "0",
                "--metrics-port", "0", *c.tls_args(), *own_disk_dir(c.worker_args, name),
                *c.role_args.get(role, ())]  # fmt: skip
        if role != "colocated":
            argv += ["--transfer-backend", c.transfer_backend]
        threads = str(c.worker_threads())
        argv += ["--num-threads", threads]
        env = {**self.env, **role_env(role), "OMP_NUM_THREADS": threads}
        worker = Worker(role, self.supervisor.start(name, argv, env))
        slots = [i for i, w in enumerate(self.workers) if w.child.name == name]
        if slots:
            self.workers[slots[0]] = worker
        else:
            self.workers.append(worker)
        if deadline is not None:
            self._wait_ready(worker, deadline)
        return worker

    def worker(self, name: str) -> Worker | None:
        return next((w for w in self.workers if w.child.name == name), None)

    def restart_worker(self, name: str) -> Worker:
        """Start the worker slot `name` again (its old process must be gone); not waiting."""
        old = self.worker(name)
        assert old is not None, name
        return self.start_worker(old.role, name=name)

    def poll_ready(self, name: str) -> bool:
        """Whether worker `name` printed its ready line (ChildFailed when it exited first)."""
        worker = self.worker(name)
        assert worker is not None, name
        if not worker.ready:
            ready = self.supervisor.poll(worker.child, WORKER_READY)
            if ready is not None:
                worker.ready = json.loads(ready.group(1))
        return bool(worker.ready)

    def _wait_ready(self, worker: Worker, deadline: float) -> None:
        ready = self.supervisor.wait_for(worker.child, WORKER_READY, deadline)
        worker.ready = json.loads(ready.group(1))

    def stop(self) -> None:
        """Drain the control plane, then stop the workers; bounded, idempotent."""
        try:
            if self.keeper is not None:
                self.keeper.stop()
            if self.control is not None and self.control.alive():
                self.supervisor.stop(self.control, grace=self.config.drain_seconds + 3.0)
        finally:  # the workers are stopped whatever happened above
            self.supervisor.close()

    def dead_children(self) -> list[Child]:
        children = [w.child for w in self.workers]
        if self.control is not None:
            children.append(self.control)
        return [c for c in children if not c.alive()]


def own_disk_dir(argv: Sequence[str], name: str) -> tuple[str, ...]:
    """`argv` with `--disk-kv-dir DIR` turned into DIR/`name`: a disk tier's folder is locked
    by one engine, so each worker gets its own, and a restarted worker (same name) finds its
    files again."""
    words = list(argv)
    for i, word in enumerate(words):
        if word == "--disk-kv-dir" and i + 1 < len(words):
            words[i + 1] = os.path.join(words[i + 1], name)
        elif word.startswith("--disk-kv-dir="):
            words[i] = "--disk-kv-dir=" + os.path.join(word.split("=", 1)[1], name)
    return tuple(words)


def role_env(role: str) -> dict[str, str]:
    """A child's tracing service name: `OTEL_SERVICE_NAME` (default "kvmesh") + "-ROLE"."""
    return {"OTEL_SERVICE_NAME": f"{os.environ.get('OTEL_SERVICE_NAME') or 'kvmesh'}-{role}"}


def kvmesh_argv() -> list[str]:
    """How to run the `kvmesh` command with this interpreter."""
    return [sys.executable, "-m", "kvmesh.cli.main"]


def resolve_model(model: str | None) -> str:
    """The checkpoint folder of `--model` (InvalidParameterError on field `model`)."""
    from kvmesh.models.resolve import resolve_model_path

    return str(resolve_model_path(model))


def wait_serving(endpoint: str, deadline: float, **client_options: Any) -> None:
    """Block until the front door reports GenerationService SERVING (ChildFailed at deadline)."""
    from kvmesh.client import Client

    with Client(endpoint, **client_options) as client:
        while not client.serving(timeout=1.0):
            if time.monotonic() >= deadline:
                raise ChildFailed(f"front door {endpoint} did not become SERVING in time")
            time.sleep(0.1)


# -- command ---------------------------------------------------------------------------------


def register(subparsers: Any) -> None:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "up", help="start control plane, prefill and decode workers locally (Ctrl-C stops)"
    )
    add = parser.add_argument
    add_engine_flags(parser, engine_flags(exclude=UP_OWN_FIELDS), omit_defaults=True)
    add("--served-model-name", default=None, help="model name clients see (every worker)")
    add("--prefill", type=int, default=None, help="prefill workers (default 1, 0 with --colocated)")
    add("--decode", type=int, default=None, help="decode workers (default 1, 0 with --colocated)")
    add("--colocated", type=int, default=0, help="colocated workers (default %(default)s)")
    add("--host", default="127.0.0.1", help="address every process binds (default %(default)s)")
    add("--port", type=int, default=None, help="front door port (default 50051; --demo: any)")
    add("--http-port", type=int, default=None,
        help="OpenAI-compatible HTTP API port (default 8000; --demo: any; -1: off)")  # fmt: skip
    add("--transfer-backend", choices=WORKER_BACKENDS, default=DEFAULT_BACKEND,
        help="KV transfer backend between prefill and decode (default %(default)s)")  # fmt: skip
    add("--threads", "--num-threads", type=int, default=None,
        help="torch (and OpenMP) threads per worker process (default: KVMESH_NUM_THREADS, "
             "else the usable cores shared among the workers)")  # fmt: skip
    add("--startup-timeout", type=float, default=180.0, help="seconds (default %(default)s)")
    add("--tls-cert", default=None, metavar="PEM", help="TLS on every port (with --tls-key)")
    add("--tls-key", default=None, metavar="PEM", help="private key of --tls-cert")
    add("--tls-ca", default=None, metavar="PEM",
        help="CA of every certificate: mutual TLS on the internal ports")  # fmt: skip
    add("--api-key-file", default=None, metavar="PATH",
        help="API keys the front door requires, one a line (default: KVMESH_API_KEY_FILE, "
             "else KVMESH_API_KEY, else open)")  # fmt: skip
    add("--drain-seconds", type=float, default=30.0,
        help="at most this long for in-flight requests at Ctrl-C; the wait is sized from the "
             "longest of them (default %(default)s)")  # fmt: skip
    add("--no-restart", action="store_true", help="do not restart dead or wedged children")
    add("--wedged-seconds", type=float, default=RestartPolicy.wedged_seconds,
        help="restart a child not answering health this long (default %(default)s)")  # fmt: skip
    add(
        "--crash-loop-limit",
        type=int,
        default=RestartPolicy.crash_loop_limit,
        help="give up on a child after this many failures in a row (default %(default)s)",
    )
    add("--verbose", action="store_true", help="show the children's logs")
    add("--demo", action="store_true", help="send one request, print it, then stop everything")
    add("--prompt", default=DEMO_PROMPT, help="prompt of the --demo request")
    add("--max-tokens", type=int, default=32, help="tokens of the --demo request")
    parser.set_defaults(func=run_up)


def run_up(args: argparse.Namespace) -> int:
    try:
        config = config_from_args(args)
        # Resolved once here: a bad --model fails in one line before any child starts.
        config = dataclasses.replace(config, model=resolve_model(config.model))
        config.client_options()  # an unusable API key (flag or environment) fails here
    except ValueError as error:
        print(f"kvmesh up: {error}", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    system = LocalSystem(config, echo=args.verbose)
    try:
        endpoint = system.start()
        print_banner(system, endpoint)
        if args.demo:
            from kvmesh.cli.generate_remote import demo

            return demo(endpoint, args.prompt, args.max_tokens, **config.client_options())
        return serve_until_stopped(system)
    except ChildFailed as error:
        print(f"kvmesh up: {error}", file=sys.stderr)
        return 1
    except KvmeshError as error:  # the --demo request (or its model info) was refused
        print(f"kvmesh up --demo: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        print("kvmesh up: stopping (draining the control plane, then the workers)", flush=True)
        system.stop()
        print("kvmesh up: stopped", flush=True)


def config_from_args(args: argparse.Namespace) -> UpConfig:
    """The UpConfig the parsed flags name, the model not resolved yet (ValueError naming the
    flag or field of a bad value)."""
    pair_default = 0 if args.colocated else 1
    engine = worker_engine_values(args)
    restart = None
    if not args.no_restart:
        restart = RestartPolicy(wedged_seconds=args.wedged_seconds,
                                crash_loop_limit=args.crash_loop_limit,
                                startup_seconds=args.startup_timeout)  # fmt: skip
    return UpConfig(
        model=engine.pop("model", None),  # resolved once, then passed to every worker
        prefill=pair_default if args.prefill is None else args.prefill,
        decode=pair_default if args.decode is None else args.decode,
        colocated=args.colocated, host=args.host,
        port=(0 if args.demo else 50051) if args.port is None else args.port,
        http_port=http_port(args),
        transfer_backend=args.transfer_backend, threads=threads_from(args, os.environ),
        startup_timeout=args.startup_timeout, drain_seconds=args.drain_seconds,
        restart=restart, worker_args=worker_argv(engine, args.served_model_name),
        tls_cert=args.tls_cert, tls_key=args.tls_key, tls_ca=args.tls_ca,
        api_key_file=args.api_key_file,
    )  # fmt: skip


def threads_from(args: argparse.Namespace, environ: Mapping[str, str]) -> int | None:
    """Threads per worker: --threads, else KVMESH_NUM_THREADS (the variable of the workers'
    --num-threads), else None (shared out by `UpConfig.worker_threads`). ValueError names the
    variable of a bad value."""
    if args.threads is not None:
        return int(args.threads)
    flags = [flag for flag in engine_flags() if flag.field in UP_OWN_FIELDS]
    values = env_values(flags, environ)
    validate(values, flags)
    threads = values.get("num_threads")
    return None if threads is None else int(threads)


def worker_engine_values(args: argparse.Namespace) -> dict[str, Any]:
    """Engine settings for every worker: `KVMESH_<FLAG>` variables, then the command line
    (ValueError naming the flag or variable of a bad value)."""
    flags = engine_flags(exclude=UP_OWN_FIELDS)
    values = {**env_values(flags, os.environ), **engine_values(args, flags)}
    validate(values, flags)
    return values


def worker_argv(engine: dict[str, Any], served_model_name: str | None) -> tuple[str, ...]:
    """`kvmesh serve ROLE` words that set `engine` (field -> value, model excluded) and the
    served model name."""
    words = engine_argv(engine, engine_flags(exclude=UP_OWN_FIELDS))
    if served_model_name:
        words += ["--served-model-name", served_model_name]
    return tuple(words)


def http_port(args: argparse.Namespace) -> int | None:
    """--http-port: 8000 by default (any free port with --demo), None when negative (off)."""
    if args.http_port is None:
        return 0 if args.demo else 8000
    return None if args.http_port < 0 else args.http_port


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def print_banner(system: LocalSystem, endpoint: str) -> None:
    c = system.config
    roles = ", ".join(f"{n} {r}" for r, n in
                      (("prefill", c.prefill), ("decode", c.decode), ("colocated", c.colocated))
                      if n)  # fmt: skip
    print(f"kvmesh is up: front door {endpoint} ({roles}; transfer {c.transfer_backend}; "
          f"model {system.model_dir})", flush=True)  # fmt: skip
    if system.http_url:
        print(f"  OpenAI-compatible API on {system.http_url}/v1", flush=True)
    print(f"  internal door {system.internal_endpoint} (ControlService; cluster token required)")
    print(f"  control plane metrics http://{system.control_metrics}/metrics")
    for w in system.workers:
        print(f"  {w.child.name}: {w.ready.get('address', '?')} "
              f"(metrics {w.ready.get('metrics_address') or 'off'})")  # fmt: skip
    print(f'  kvmesh generate --target {endpoint} "Hello"')
    if system.http_url:
        print(f"  curl {system.http_url}/v1/completions -H 'Content-Type: application/json' "
              f"""-d '{{"prompt": "Hello", "max_tokens": 16}}'""")  # fmt: skip
    print(f'  python -c \'from kvmesh.client import Client; '
          f'print(Client("{endpoint}").complete("Hello").text)\'')  # fmt: skip
    print("Ctrl-C drains and stops everything.", flush=True)


def serve_until_stopped(system: LocalSystem) -> int:
    """Wait for Ctrl-C/SIGTERM (KeyboardInterrupt); exit 1 early if the control plane dies
    for good (with restarts: once they were given up)."""
    reported: set[str] = set()
    while True:
        time.sleep(POLL_SECONDS)
        if system.keeper is not None:
            control = system.keeper.watches.get("control")
            if control is not None and control.given_up:
                return 1
            continue
        for child in system.dead_children():
            if child.name not in reported:
                reported.add(child.name)
                print(f"kvmesh up: {child.name} exited with {child.process.returncode}\n"
                      f"{child.output_tail()}", file=sys.stderr, flush=True)  # fmt: skip
                if child is system.control:
                    return 1


def main(argv: Sequence[str] | None = None) -> int:
    from kvmesh.cli.main import main as kvmesh_main

    return kvmesh_main(["up", *(argv or [])])
