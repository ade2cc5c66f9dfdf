"""Builders shared by the control-plane tests (worker infos, layouts, loads)."""

from __future__ import annotations

from kvmesh.v1 import generation_pb2, worker_pb2

ROLES = {
    "prefill": worker_pb2.WORKER_ROLE_PREFILL,
    "decode": worker_pb2.WORKER_ROLE_DECODE,
    "colocated": worker_pb2.WORKER_ROLE_COLOCATED,
}


def layout(block_size: int = 16, dtype: str = "float32") -> worker_pb2.KVCacheLayout:
    return worker_pb2.KVCacheLayout(
        num_layers=2,
        num_kv_heads=2,
        head_dim=8,
        block_size=block_size,
        dtype=dtype,
        kv_dtype="auto",
        layout="block-major-v1",
        model_fingerprint="tiny",
    )


def worker_info(
    worker_id: str,
    role: str,
    *,
    epoch: int = 1,
    address: str = "127.0.0.1:1",
    kv_layout: worker_pb2.KVCacheLayout | None = None,
    num_blocks: int = 64,
) -> worker_pb2.WorkerInfo:
    return worker_pb2.WorkerInfo(
        worker_id=worker_id,
        role=ROLES[role],
        address=address,
        epoch=epoch,
        layout=kv_layout or layout(),
        num_blocks=num_blocks,
        transfer_endpoints={"fake": f"{worker_id}-inbox"},
        model=generation_pb2.ModelInfo(
            model_name="tiny", vocab_size=256, max_model_len=512, block_size=16
        ),
    )


def load(free: int = 64, running: int = 0, waiting: int = 0) -> worker_pb2.WorkerLoad:
    return worker_pb2.WorkerLoad(
        total_blocks=64, free_blocks=free, running=running, waiting=waiting
    )


class FakeClock:
    """A clock the test moves by hand."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now
