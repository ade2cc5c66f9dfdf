"""A raw HTTP/2 client for tests of gRPC servers' connection bounds.

Import as `from tests.http2 import closed_with_goaway` (the repository root is on the test path)."""

from __future__ import annotations

import asyncio
import struct

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
SETTINGS, PING, GOAWAY, ACK = 4, 6, 7, 1


def frame(kind: int, flags: int = 0, payload: bytes = b"") -> bytes:
    return len(payload).to_bytes(3, "big") + bytes([kind, flags]) + struct.pack(">I", 0) + payload


async def closed_with_goaway(address: str, seconds: float = 5.0) -> bool:
    """Hold a raw HTTP/2 connection open without calls (SETTINGS and pings acknowledged):
    whether the server sent GOAWAY and closed it within `seconds`."""
    host, port = address.rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(PREFACE + frame(SETTINGS))
    goaway = False
    try:
        async with asyncio.timeout(seconds):
            while head := await reader.read(9):
                head += await reader.readexactly(9 - len(head))
                kind, flags = head[3], head[4]
                payload = await reader.readexactly(int.from_bytes(head[:3], "big"))
                goaway = goaway or kind == GOAWAY
                if kind in (SETTINGS, PING) and not flags & ACK:
                    writer.write(frame(kind, ACK, payload if kind == PING else b""))
    except TimeoutError:
        return False
    finally:
        writer.close()
    return goaway
