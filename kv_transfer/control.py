"""Header-framed messages over a stream socket, with deadlines on every read."""

from __future__ import annotations

import os
import socket
import struct
import time

from kv_transfer.errors import AuthenticationError, DeadlineExpiredError, FrameError, PeerError
from kv_transfer.header import HEADER_SIZE, NO_PAYLOAD_FLAGS, FrameHeader, decode_header

MAX_CONTROL_PAYLOAD = 1 << 20


def send_msg(
    sock: socket.socket,
    header: FrameHeader,
    payload: bytes | memoryview = b"",
    *,
    after: bytes = b"",
) -> None:
    """Write one message (header + payload), behind `after` (encoded messages sent in the same
    write); a broken connection raises `PeerError`."""
    try:
        sock.sendall(after + header.encode())
        if len(payload):
            sock.sendall(payload)
    except TimeoutError:
        raise DeadlineExpiredError("deadline passed sending to the peer") from None
    except OSError as exc:
        raise PeerError(f"send failed: {exc}") from None


def _recv_exact(sock: socket.socket, view: memoryview, deadline: float) -> None:
    got = 0
    while got < view.nbytes:
        left = deadline - time.monotonic()
        if left <= 0:
            raise DeadlineExpiredError("deadline passed waiting for the peer")
        try:
            sock.settimeout(left)  # inside: a socket closed by another thread raises here
            n = sock.recv_into(view[got:])
        except TimeoutError:
            raise DeadlineExpiredError("deadline passed waiting for the peer") from None
        except OSError as exc:
            raise PeerError(f"receive failed: {exc}") from None
        if n == 0:
            raise PeerError("peer closed the connection")
        got += n


def recv_msg(
    sock: socket.socket, deadline: float, max_payload: int = MAX_CONTROL_PAYLOAD
) -> tuple[FrameHeader, bytearray]:
    """Read one message by `deadline` (absolute monotonic); payloads above max are refused."""
    raw = bytearray(HEADER_SIZE)
    _recv_exact(sock, memoryview(raw), deadline)
    header = decode_header(raw)
    if header.flags & NO_PAYLOAD_FLAGS:
        return header, bytearray()
    if header.payload_len > max_payload:
        raise FrameError("payload_len", f"{header.payload_len} above limit {max_payload}")
    payload = bytearray(header.payload_len)
    if header.payload_len:
        _recv_exact(sock, memoryview(payload), deadline)
        header.verify_payload(payload)
    return header, payload


def require_same_user(sock: socket.socket) -> int:
    """Check via SO_PEERCRED that the Unix-socket peer runs as our uid; return its pid."""
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, _gid = struct.unpack("3i", creds)
    if uid != os.getuid():
        raise AuthenticationError(f"peer uid {uid} is not our uid {os.getuid()}")
    return int(pid)


def unix_path(address: str) -> str:
    if not address.startswith("unix:"):
        raise FrameError("address", f"expected unix:PATH, got {address!r}")
    return address.removeprefix("unix:")
