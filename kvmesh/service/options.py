"""Command-line options every worker role shares, and building its runtime from them.

Building the parser imports neither torch nor the engine: `kvmesh serve ROLE --help` and the
deploy checks stay fast. The engine is imported when a runtime is built.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from kvmesh.engine.config import EngineConfig
from kvmesh.security.flags import add_security_flags
from kvmesh.service.engine_flags import (
    add_engine_flags,
    apply_env,
    check_values,
    engine_flags,
    engine_values,
)
from kvmesh.service.server import DEFAULT_MAX_CONNECTION_IDLE_SECONDS, DEFAULT_MAX_MESSAGE_BYTES
from kvmesh.telemetry.logs import add_log_flags
from kvmesh.v1 import worker_pb2
from kvmesh.v1.transfer import BACKENDS, WORKER_BACKENDS

if TYPE_CHECKING:
    from kvmesh.service.runtime import WorkerRuntime

ROLES = {
    "prefill": worker_pb2.WORKER_ROLE_PREFILL,
    "decode": worker_pb2.WORKER_ROLE_DECODE,
    "colocated": worker_pb2.WORKER_ROLE_COLOCATED,
}
SERVED_NAME_ENV = "KVMESH_SERVED_MODEL_NAME"


def parser(role: str, *, transfer: bool = True) -> argparse.ArgumentParser:
    """Every option of `kvmesh serve ROLE`: the engine's (generated from EngineConfig, see
    `kvmesh.service.engine_flags`) and the worker's own."""
    p = argparse.ArgumentParser(prog=f"kvmesh serve {role}", description=f"kvmesh {role} worker")
    add_engine_flags(p, engine_flags())
    p.add_argument("--served-model-name", default=None,
                   help="model name clients see (default: the checkpoint folder's name; "
                   "env KVMESH_SERVED_MODEL_NAME)")  # fmt: skip
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0, help="0 picks a free port")
    p.add_argument("--control", default=None,
                   help="the control plane's --internal-port HOST:PORT")  # fmt: skip
    p.add_argument("--worker-id", default=None, help="default: ROLE-HOST-PID")
    if transfer:
        p.add_argument(
            "--transfer-backend",
            action="append",
            choices=BACKENDS,
            help=f"KV transfer backend(s) (repeatable; default {', '.join(WORKER_BACKENDS)})",
        )
    if transfer and role == "decode":  # only a decode worker receives KV
        p.add_argument(
            "--transfer-port",
            type=int,
            default=0,
            help="first port of the network KV receivers (grpc, gloo: one port each, in order, "
            "on --host); 0 picks free ports",
        )
    if role == "prefill":
        p.add_argument(
            "--transfer-overlap",
            action=argparse.BooleanOptionalAction,
            default=True,
            help="send each prefill chunk's full KV blocks while the next chunk computes "
            "(--no-transfer-overlap: send the whole block set after the first token)",
        )
    p.add_argument("--metrics-port", type=int, default=None, help="Prometheus port (0 = pick)")
    p.add_argument("--reflection", action="store_true", help="serve gRPC server reflection")
    p.add_argument("--drain-seconds", type=float, default=10.0)
    p.add_argument(
        "--max-message-bytes",
        type=int,
        default=DEFAULT_MAX_MESSAGE_BYTES,
        help="largest gRPC message of the worker port (default %(default)s)",
    )
    p.add_argument(
        "--max-connection-idle-seconds",
        type=positive_seconds,
        default=DEFAULT_MAX_CONNECTION_IDLE_SECONDS,
        help="a connection to the worker port without calls for this long is closed with "
        "GOAWAY (default %(default)s)",
    )
    add_security_flags(p)
    add_log_flags(p)
    return p


def positive_seconds(text: str) -> float:
    """An argparse type: a number of seconds above 0."""
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be above 0, got {text}")
    return value


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """The EngineConfig of parsed options (the model folder resolved)."""
    from kvmesh.engine.loader import resolve_model_path

    values = engine_values(args, engine_flags())
    values["model"] = str(resolve_model_path(values.get("model")))
    return EngineConfig(**values)


def build_runtime(
    config: EngineConfig,
    role: str,
    worker_id: str | None = None,
    served_model_name: str | None = None,
) -> WorkerRuntime:
    """Load the model, warm it up (kernels built and loaded, one step run; see
    `kvmesh.engine.warmup`), start the engine thread and describe the worker (its ModelInfo
    names the model `served_model_name`, default the checkpoint folder's name)."""
    from kvmesh.engine.async_engine import AsyncLLMEngine
    from kvmesh.engine.engine import LLMEngine
    from kvmesh.engine.warmup import warm_up
    from kvmesh.service.runtime import (
        WorkerRuntime,
        layout_of,
        model_fingerprint,
        model_info,
        new_epoch,
    )

    engine = LLMEngine(config)
    warmup = warm_up(engine)  # before the engine thread starts: nothing else uses the engine
    fingerprint = model_fingerprint(engine.parts.loaded.path)
    return WorkerRuntime(
        engine=AsyncLLMEngine(engine=engine, name=f"kvmesh-{role}-engine"),
        worker_id=worker_id or default_worker_id(role),
        epoch=new_epoch(),
        layout=layout_of(engine, fingerprint),
        model=model_info(engine, role, served_model_name),
        warmup=warmup.as_dict(),
    )


def default_worker_id(role: str) -> str:
    return f"{role}-{os.uname().nodename}-{os.getpid()}"


def parse(
    role: str,
    argv: Sequence[str] | None,
    *,
    transfer: bool = True,
    environ: Mapping[str, str] | None = None,
) -> argparse.Namespace:
    """Parsed options: `KVMESH_*` variables of `environ` (default os.environ) set defaults, the
    command line wins; an invalid value exits with an error naming its flag or variable."""
    environ = os.environ if environ is None else environ
    p = parser(role, transfer=transfer)
    flags = engine_flags()
    apply_env(p, flags, environ)
    if SERVED_NAME_ENV in environ:
        p.set_defaults(served_model_name=environ[SERVED_NAME_ENV])
    args = p.parse_args(list(argv or []))
    check_values(p, args, flags)
    return args
