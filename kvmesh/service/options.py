"""Command-line options every worker role shares, and building its runtime from them.

Building the parser imports neither torch nor the engine: `kvmesh serve ROLE --help` and the
deploy checks stay fast. The engine is imported when a runtime is built.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvmesh.engine.config import SCHEDULING_POLICIES, EngineConfig
from kvmesh.v1 import worker_pb2

if TYPE_CHECKING:
    from kvmesh.service.runtime import WorkerRuntime

ROLES = {
    "prefill": worker_pb2.WORKER_ROLE_PREFILL,
    "decode": worker_pb2.WORKER_ROLE_DECODE,
    "colocated": worker_pb2.WORKER_ROLE_COLOCATED,
}


def _size(text: str) -> int:
    """Bytes from `123`, `512MiB`, `2GiB`, `1G`."""
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
    value = text.strip().lower().removesuffix("ib").removesuffix("b")
    if value and value[-1] in units:
        return int(float(value[:-1]) * units[value[-1]])
    return int(value)


def parser(role: str, *, transfer: bool = True) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=f"kvmesh serve {role}", description=f"kvmesh {role} worker")
    p.add_argument(
        "--model",
        default=None,
        help="checkpoint folder, .gguf file or hub id Org/Name (default: SmolLM2-135M-Instruct)",
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0, help="0 picks a free port")
    p.add_argument("--control", default=None, help="control plane HOST:PORT to register with")
    p.add_argument("--worker-id", default=None, help="default: ROLE-HOST-PID")
    p.add_argument("--kv-cache-memory", type=_size, default=None, help="KV budget, e.g. 256MiB")
    p.add_argument("--num-kv-blocks", type=int, default=None, help="exact KV pool size")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--no-chunked-prefill", action="store_true")
    p.add_argument(
        "--scheduling-policy",
        choices=SCHEDULING_POLICIES,
        default="decode-first",
        help="decode-first: running decodes join every step; prefill-first: a step that can do "
        "prompt work runs only prompt chunks (bounded decode stall)",
    )
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    p.add_argument("--num-threads", type=int, default=None, help="torch CPU threads")
    if transfer:
        p.add_argument(
            "--transfer-backend",
            action="append",
            choices=("shm", "gloo", "grpc", "cuda_ipc", "fake"),
            help="KV transfer backend(s) (repeatable; default shm and grpc)",
        )
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
    return p


def engine_config(args: argparse.Namespace) -> EngineConfig:
    from kvmesh.engine.loader import resolve_model_path

    return EngineConfig(
        model=str(resolve_model_path(args.model)),
        device=args.device,
        block_size=args.block_size,
        kv_cache_memory=args.kv_cache_memory,
        num_kv_blocks=args.num_kv_blocks,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        enable_chunked_prefill=not args.no_chunked_prefill,
        scheduling_policy=args.scheduling_policy,
        num_threads=args.num_threads,
    )


def build_runtime(config: EngineConfig, role: str, worker_id: str | None = None) -> WorkerRuntime:
    """Load the model, start the engine thread and describe the worker."""
    from kvmesh.engine.async_engine import AsyncLLMEngine
    from kvmesh.engine.engine import LLMEngine
    from kvmesh.service.runtime import (
        WorkerRuntime,
        layout_of,
        model_fingerprint,
        model_info,
        new_epoch,
    )

    engine = LLMEngine(config)
    fingerprint = model_fingerprint(engine.parts.loaded.path)
    return WorkerRuntime(
        engine=AsyncLLMEngine(engine=engine, name=f"kvmesh-{role}-engine"),
        worker_id=worker_id or default_worker_id(role),
        epoch=new_epoch(),
        layout=layout_of(engine, fingerprint),
        model=model_info(engine, role),
    )


def default_worker_id(role: str) -> str:
    return f"{role}-{os.uname().nodename}-{os.getpid()}"


def parse(role: str, argv: Sequence[str] | None, *, transfer: bool = True) -> argparse.Namespace:
    return parser(role, transfer=transfer).parse_args(list(argv or []))
