"""KV transfer names of the wire contract, defined once for every process (handwritten).

`BACKENDS` are the values of `KVTarget.backend` and the keys of `transfer_endpoints`, in the
control plane's default order of preference; `WORKER_BACKENDS` is what a worker offers when
`--transfer-backend` is not given (`kvmesh up` picks its one backend among them, default
`DEFAULT_BACKEND`). `TransferCode` is the stable code of every transfer error: carried on the
wire (`PushResult.error_code`, ERROR frames) and mapped to a gRPC status once, by code.
"""

from __future__ import annotations

import enum

BACKENDS = ("cuda_ipc", "shm", "gloo", "grpc", "fake")
WORKER_BACKENDS = ("shm", "grpc", "gloo")
DEFAULT_BACKEND = "shm"
NETWORK_BACKENDS = ("gloo", "grpc")  # bytes may cross hosts: payload checksums always on


class TransferCode(enum.StrEnum):
    TRANSFER_ERROR = "transfer_error"
    LAYOUT_MISMATCH = "layout_mismatch"
    BAD_FRAME = "bad_frame"
    CHECKSUM = "checksum"
    UNKNOWN_TRANSFER = "unknown_transfer"
    STALE_EPOCH = "stale_epoch"
    BAD_STATE = "bad_state"
    ILLEGAL_TRANSITION = "illegal_transition"
    CANCELLED = "cancelled"
    DEADLINE = "deadline"
    PEER = "peer"
    AUTH = "auth"
    UNAVAILABLE = "unavailable"
