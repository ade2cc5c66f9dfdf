from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class HandshakeRequest(_message.Message):
    __slots__ = ("layout",)
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    layout: bytes
    def __init__(self, layout: _Optional[bytes] = ...) -> None: ...

class HandshakeReply(_message.Message):
    __slots__ = ("layout",)
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    layout: bytes
    def __init__(self, layout: _Optional[bytes] = ...) -> None: ...

class KVFrame(_message.Message):
    __slots__ = ("msg_type", "transfer_id", "epoch", "frame_index", "frame_count", "block_offset", "num_blocks", "payload_len", "checksum", "flags", "dst_block_ids", "payload")
    MSG_TYPE_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    FRAME_INDEX_FIELD_NUMBER: _ClassVar[int]
    FRAME_COUNT_FIELD_NUMBER: _ClassVar[int]
    BLOCK_OFFSET_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_LEN_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    FLAGS_FIELD_NUMBER: _ClassVar[int]
    DST_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    msg_type: int
    transfer_id: bytes
    epoch: int
    frame_index: int
    frame_count: int
    block_offset: int
    num_blocks: int
    payload_len: int
    checksum: int
    flags: int
    dst_block_ids: _containers.RepeatedScalarFieldContainer[int]
    payload: bytes
    def __init__(self, msg_type: _Optional[int] = ..., transfer_id: _Optional[bytes] = ..., epoch: _Optional[int] = ..., frame_index: _Optional[int] = ..., frame_count: _Optional[int] = ..., block_offset: _Optional[int] = ..., num_blocks: _Optional[int] = ..., payload_len: _Optional[int] = ..., checksum: _Optional[int] = ..., flags: _Optional[int] = ..., dst_block_ids: _Optional[_Iterable[int]] = ..., payload: _Optional[bytes] = ...) -> None: ...

class PushResult(_message.Message):
    __slots__ = ("state", "error_code", "message", "num_bytes")
    STATE_FIELD_NUMBER: _ClassVar[int]
    ERROR_CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    NUM_BYTES_FIELD_NUMBER: _ClassVar[int]
    state: str
    error_code: str
    message: str
    num_bytes: int
    def __init__(self, state: _Optional[str] = ..., error_code: _Optional[str] = ..., message: _Optional[str] = ..., num_bytes: _Optional[int] = ...) -> None: ...
