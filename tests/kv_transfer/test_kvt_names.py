"""Backend names, defaults and transfer error codes are defined once (kvmesh.v1.transfer)."""

from __future__ import annotations

import grpc

import kv_transfer
from control_plane.routing import RoutingConfig
from kv_transfer import errors
from kvmesh.service.options import parser as worker_parser
from kvmesh.service.status import status_of
from kvmesh.v1 import transfer
from kvmesh.v1.status import TRANSFER_CODES


def test_every_name_is_a_backend_and_every_backend_a_name() -> None:
    assert tuple(kv_transfer.BACKENDS) == transfer.BACKENDS
    assert set(transfer.WORKER_BACKENDS) <= set(transfer.BACKENDS)
    assert transfer.DEFAULT_BACKEND in transfer.WORKER_BACKENDS
    assert set(transfer.NETWORK_BACKENDS) <= set(transfer.BACKENDS)
    assert RoutingConfig().transfer_backends == transfer.BACKENDS  # nccl is no backend name


def test_worker_flag_offers_exactly_the_backends() -> None:
    parser = worker_parser("decode")
    action = next(a for a in parser._actions if a.dest == "transfer_backend")
    assert tuple(action.choices or ()) == transfer.BACKENDS
    assert ", ".join(transfer.WORKER_BACKENDS) in (action.help or "")


def test_every_transfer_error_has_a_code_and_a_status() -> None:
    classes = [c for c in vars(errors).values() if isinstance(c, type)]
    classes = [c for c in classes if issubclass(c, errors.TransferError)]
    assert {c.code for c in classes} == set(transfer.TransferCode) == set(TRANSFER_CODES)
    for cls in classes:
        if cls is errors.LayoutMismatchError or issubclass(cls, errors.FrameError):
            continue
        back = errors.parse_wire_error(errors.error_to_wire(cls("why")))
        assert type(back) is cls and str(back) == "why"
    code, message = status_of(errors.StaleEpochError("epoch 3 != 4"))
    assert (code, message) == (grpc.StatusCode.FAILED_PRECONDITION, "kv transfer: epoch 3 != 4")
    assert isinstance(errors.parse_wire_error(b"no such code\0x"), errors.PeerError)
