"""cuda_ipc: what does not need a GPU (authentication, handle encoding) runs everywhere."""

from __future__ import annotations

import os
import socket
import time

import pytest
import torch

from kv_transfer import BlockStore, TransferRequest, get_backend, new_transfer_id
from kv_transfer.backends import cuda_ipc
from kv_transfer.control import recv_msg, require_same_user, send_msg, unix_path
from kv_transfer.errors import AuthenticationError, BackendUnavailableError, FrameError
from kv_transfer.header import MsgType, frame_header

SHAPE = (8, 1, 2, 4, 1, 8)


def cpu_store() -> BlockStore:
    return BlockStore(torch.zeros(SHAPE, dtype=torch.bfloat16))


def test_handle_round_trip_and_garbage_refused() -> None:
    fields = (0, b"\x01" * 64, 4096, 0, b"rc", 3, b"\x02" * 64, True)
    encoded = cuda_ipc.encode_handle(fields)
    assert cuda_ipc.decode_handle(encoded) == fields
    with pytest.raises(FrameError) as info:
        cuda_ipc.decode_handle({**encoded, "handle": "zz"})
    assert info.value.field == "handle"
    with pytest.raises(FrameError):
        cuda_ipc.decode_handle({**encoded, "size_bytes": "4096"})
    with pytest.raises(FrameError):
        cuda_ipc.decode_handle([1, 2])
    with pytest.raises(FrameError):
        cuda_ipc.split_address("unix:/tmp/x.sock")  # no token


def hello(token: str) -> bytes:
    return cuda_ipc.hello_payload(cpu_store().layout, token, {"slot_bytes": 1})


@pytest.mark.parametrize("offered", ["wrong", ""])
def test_wrong_token_is_refused_before_any_handle(offered: str) -> None:
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    with ours, theirs:
        payload = hello(offered)
        send_msg(theirs, frame_header(MsgType.HELLO, bytes(16), 0, payload), payload)
        with pytest.raises(AuthenticationError):
            cuda_ipc.authenticate(ours, "right-token", time.monotonic() + 5)
        header, body = recv_msg(theirs, time.monotonic() + 5)
        assert header.msg_type is MsgType.ERROR and body.startswith(b"auth\0")


def test_right_token_passes() -> None:
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    with ours, theirs:
        payload = hello("tok")
        send_msg(theirs, frame_header(MsgType.HELLO, bytes(16), 0, payload), payload)
        layout, extras = cuda_ipc.authenticate(ours, "tok", time.monotonic() + 5)
        assert layout == cpu_store().layout and extras["slot_bytes"] == 1


def test_other_uid_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    with ours, theirs:
        require_same_user(ours)
        monkeypatch.setattr(os, "getuid", lambda: os.geteuid() + 4242)
        with pytest.raises(AuthenticationError, match="uid"):
            require_same_user(ours)


def test_receiver_refuses_a_peer_without_the_token() -> None:
    receiver = cuda_ipc.Receiver(cpu_store(), require_cuda=False)
    try:
        base, token = cuda_ipc.split_address(receiver.address)
        assert len(token) == 32
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            conn.connect(unix_path(base))
            payload = hello("guess")
            send_msg(conn, frame_header(MsgType.HELLO, bytes(16), 0, payload), payload)
            header, body = recv_msg(conn, time.monotonic() + 5)
        assert header.msg_type is MsgType.ERROR and body.startswith(b"auth\0")
    finally:
        receiver.close()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on machines without CUDA")
def test_without_cuda_the_backend_is_unavailable() -> None:
    with pytest.raises(BackendUnavailableError):
        get_backend("cuda_ipc").Receiver(cpu_store())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA IPC needs a CUDA device")
@pytest.mark.parametrize("mode", ["registered", "staging"])
def test_cuda_ipc_moves_blocks_exactly_in_process(mode: str) -> None:
    """Registered: one device copy into the receiver's cache under a granted window (the shm
    protocol); staging: through the sender's shared ring."""
    gen = torch.Generator().manual_seed(0)
    src = BlockStore(torch.randn(SHAPE, generator=gen).to(torch.bfloat16).cuda())
    dst = BlockStore(torch.zeros(SHAPE, dtype=torch.bfloat16, device="cuda"))
    receiver = cuda_ipc.Receiver(dst)
    sender = cuda_ipc.Sender(src, receiver.address, frame_bytes=1024, mode=mode)
    assert sender.registered is (mode == "registered")
    try:
        req = TransferRequest(new_transfer_id(), 1)
        handle = receiver.expect(req, [4, 5, 6], time.monotonic() + 10)
        assert sender.send(req, [0, 1, 2], [4, 5, 6], deadline=time.monotonic() + 10).ok
        assert handle.wait().ok
        assert torch.equal(dst.cache[4:7].cpu(), src.cache[0:3].cpu())
    finally:
        sender.close()
        receiver.close()
