"""Fixed binary frame header. Every message on every backend is this header plus raw payload.

```
offset size field          meaning
0      4    magic          b"KVMF"
4      2    version        1
6      1    msg_type       MsgType
7      1    flags          FLAG_* bits
8      16   transfer_id    chosen by the transfer's owner; fences frames to one reservation
24     8    epoch          reservation generation; a stale peer's frames are refused
32     4    frame_index    0-based frame number inside the transfer
36     4    frame_count    frames in the transfer
40     4    block_offset   index of the frame's first block within the block set
44     4    num_blocks     blocks carried by this frame
48     8    payload_len    payload bytes following the header (or in the staging slot)
56     8    aux            backend-specific (shared-memory slot index)
64     8    checksum       xxh3_64 of the payload (0 with FLAG_NO_CHECKSUM)
72     4    header_check   xxh32 of bytes 0..71
76     4    reserved       zero
```
All integers little-endian.
"""

from __future__ import annotations

import dataclasses
import enum
import os
import struct

import xxhash

from kv_transfer.errors import ChecksumError, FrameError

MAGIC = b"KVMF"
VERSION = 1
_STRUCT = struct.Struct("<4sHBB16sQIIIIQQQ")
_CHECK = struct.Struct("<I4x")
HEADER_SIZE = _STRUCT.size + _CHECK.size  # 80
MAX_PAYLOAD = 1 << 40
FLAG_NO_CHECKSUM = 0x01
FLAG_IN_SLOT = 0x02  # payload lies in a shared staging slot (aux), not after the header
FLAG_IN_PLACE = 0x04  # payload already written into the receiver's granted window (a commit)
FLAG_NO_KV = 0x08  # END: the producer has no KV to ship (the trailer alone completes it)
_KNOWN_FLAGS = FLAG_NO_CHECKSUM | FLAG_IN_SLOT | FLAG_IN_PLACE | FLAG_NO_KV
NO_PAYLOAD_FLAGS = FLAG_IN_SLOT | FLAG_IN_PLACE  # no payload bytes follow the header
MAX_TRAILER = 64 << 10  # END payload: the producer's opaque trailer


class MsgType(enum.IntEnum):
    HELLO = 1  # payload: KVLayout.to_bytes() (+ backend extras)
    HELLO_ACK = 2  # payload: backend extras
    BEGIN = 3  # payload: destination block ids, u32 little-endian
    ACCEPT = 4  # receiver accepted BEGIN (registered memory: payload is the write window)
    FRAME = 5  # payload: [scales of num_blocks][kv of num_blocks] (or a commit, FLAG_IN_PLACE)
    FRAME_ACK = 6  # receiver consumed the frame (aux = slot freed)
    END = 7  # sender sent every frame; payload: the trailer (opaque to kv_transfer)
    DONE = 8  # receiver wrote every block: transfer COMPLETED
    CANCEL = 9  # either side: stop this transfer
    ERROR = 10  # payload: errors.error_to_wire


@dataclasses.dataclass(frozen=True)
class FrameHeader:
    msg_type: MsgType
    transfer_id: bytes = bytes(16)
    epoch: int = 0
    frame_index: int = 0
    frame_count: int = 0
    block_offset: int = 0
    num_blocks: int = 0
    payload_len: int = 0
    aux: int = 0
    checksum: int = 0
    flags: int = 0

    def encode(self) -> bytes:
        body = _STRUCT.pack(
            MAGIC,
            VERSION,
            int(self.msg_type),
            self.flags,
            self.transfer_id,
            self.epoch,
            self.frame_index,
            self.frame_count,
            self.block_offset,
            self.num_blocks,
            self.payload_len,
            self.aux,
            self.checksum,
        )
        return body + _CHECK.pack(xxhash.xxh32_intdigest(body))

    def verify_payload(self, payload: object) -> None:
        """Raise `ChecksumError` unless `payload` (a buffer) matches length and checksum."""
        length = memoryview(payload).nbytes  # type: ignore[arg-type]
        if length != self.payload_len:
            raise FrameError("payload_len", f"header says {self.payload_len}, got {length}")
        if self.flags & FLAG_NO_CHECKSUM:
            return
        actual = payload_checksum(payload)
        if actual != self.checksum:
            raise ChecksumError("checksum", f"payload {actual:#x} != header {self.checksum:#x}")


def payload_checksum(payload: object) -> int:
    return xxhash.xxh3_64_intdigest(payload)  # type: ignore[arg-type]


def decode_header(data: bytes | bytearray | memoryview) -> FrameHeader:
    """Parse exactly HEADER_SIZE bytes; every defect raises `FrameError` naming the field."""
    view = memoryview(data)
    if view.nbytes != HEADER_SIZE:
        raise FrameError("header", f"need {HEADER_SIZE} bytes, got {view.nbytes}")
    body = view[: _STRUCT.size]
    fields = _STRUCT.unpack(body)
    (
        magic,
        version,
        msg_type,
        flags,
        tid,
        epoch,
        index,
        count,
        offset,
        nblocks,
        plen,
        aux,
        csum,
    ) = fields
    if magic != MAGIC:
        raise FrameError("magic", f"expected {MAGIC!r}, got {magic!r}")
    if version != VERSION:
        raise FrameError("version", f"expected {VERSION}, got {version}")
    (check,) = _CHECK.unpack(view[_STRUCT.size :])
    if check != xxhash.xxh32_intdigest(body):
        raise ChecksumError("header_check", "header bytes corrupted")
    try:
        kind = MsgType(msg_type)
    except ValueError:
        raise FrameError("msg_type", f"unknown message type {msg_type}") from None
    if flags & ~_KNOWN_FLAGS:
        raise FrameError("flags", f"unknown flag bits {flags:#x}")
    if plen > MAX_PAYLOAD:
        raise FrameError("payload_len", f"{plen} exceeds {MAX_PAYLOAD}")
    if kind is MsgType.FRAME and (count == 0 or index >= count):
        raise FrameError("frame_index", f"{index} not below frame_count {count}")
    return FrameHeader(kind, tid, epoch, index, count, offset, nblocks, plen, aux, csum, flags)


def new_transfer_id() -> bytes:
    """A fresh random 16-byte transfer id."""
    return os.urandom(16)


def frame_header(
    msg_type: MsgType, transfer_id: bytes, epoch: int, payload: object = b"", **fields: int
) -> FrameHeader:
    """Header for `payload` with its length and checksum filled in."""
    length = memoryview(payload).nbytes  # type: ignore[arg-type]
    return FrameHeader(
        msg_type,
        transfer_id,
        epoch,
        payload_len=length,
        checksum=payload_checksum(payload) if length else 0,
        **fields,
    )
