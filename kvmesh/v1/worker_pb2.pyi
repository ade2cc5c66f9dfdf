from kvmesh.v1 import generation_pb2 as _generation_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class WorkerRole(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    WORKER_ROLE_UNSPECIFIED: _ClassVar[WorkerRole]
    WORKER_ROLE_PREFILL: _ClassVar[WorkerRole]
    WORKER_ROLE_DECODE: _ClassVar[WorkerRole]
    WORKER_ROLE_COLOCATED: _ClassVar[WorkerRole]

class BlockSetState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    BLOCK_SET_STATE_UNSPECIFIED: _ClassVar[BlockSetState]
    BLOCK_SET_STATE_RESERVED: _ClassVar[BlockSetState]
    BLOCK_SET_STATE_FILLING: _ClassVar[BlockSetState]
    BLOCK_SET_STATE_SENDING: _ClassVar[BlockSetState]
    BLOCK_SET_STATE_TRANSFERRED: _ClassVar[BlockSetState]
    BLOCK_SET_STATE_DECODING: _ClassVar[BlockSetState]
WORKER_ROLE_UNSPECIFIED: WorkerRole
WORKER_ROLE_PREFILL: WorkerRole
WORKER_ROLE_DECODE: WorkerRole
WORKER_ROLE_COLOCATED: WorkerRole
BLOCK_SET_STATE_UNSPECIFIED: BlockSetState
BLOCK_SET_STATE_RESERVED: BlockSetState
BLOCK_SET_STATE_FILLING: BlockSetState
BLOCK_SET_STATE_SENDING: BlockSetState
BLOCK_SET_STATE_TRANSFERRED: BlockSetState
BLOCK_SET_STATE_DECODING: BlockSetState

class KVCacheLayout(_message.Message):
    __slots__ = ("num_layers", "num_kv_heads", "head_dim", "block_size", "dtype", "kv_dtype", "layout", "model_fingerprint")
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    KV_DTYPE_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: str
    kv_dtype: str
    layout: str
    model_fingerprint: str
    def __init__(self, num_layers: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., block_size: _Optional[int] = ..., dtype: _Optional[str] = ..., kv_dtype: _Optional[str] = ..., layout: _Optional[str] = ..., model_fingerprint: _Optional[str] = ...) -> None: ...

class WorkerInfo(_message.Message):
    __slots__ = ("worker_id", "role", "address", "epoch", "layout", "num_blocks", "transfer_endpoints", "model", "metrics_address")
    class TransferEndpointsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_ENDPOINTS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    METRICS_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    role: WorkerRole
    address: str
    epoch: int
    layout: KVCacheLayout
    num_blocks: int
    transfer_endpoints: _containers.ScalarMap[str, str]
    model: _generation_pb2.ModelInfo
    metrics_address: str
    def __init__(self, worker_id: _Optional[str] = ..., role: _Optional[_Union[WorkerRole, str]] = ..., address: _Optional[str] = ..., epoch: _Optional[int] = ..., layout: _Optional[_Union[KVCacheLayout, _Mapping]] = ..., num_blocks: _Optional[int] = ..., transfer_endpoints: _Optional[_Mapping[str, str]] = ..., model: _Optional[_Union[_generation_pb2.ModelInfo, _Mapping]] = ..., metrics_address: _Optional[str] = ...) -> None: ...

class HeldBlockSet(_message.Message):
    __slots__ = ("request_id", "state", "num_blocks", "generation", "lease_remaining_seconds")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    LEASE_REMAINING_SECONDS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    state: BlockSetState
    num_blocks: int
    generation: int
    lease_remaining_seconds: float
    def __init__(self, request_id: _Optional[str] = ..., state: _Optional[_Union[BlockSetState, str]] = ..., num_blocks: _Optional[int] = ..., generation: _Optional[int] = ..., lease_remaining_seconds: _Optional[float] = ...) -> None: ...

class WorkerLoad(_message.Message):
    __slots__ = ("total_blocks", "free_blocks", "cached_blocks", "running", "waiting")
    TOTAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    CACHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    total_blocks: int
    free_blocks: int
    cached_blocks: int
    running: int
    waiting: int
    def __init__(self, total_blocks: _Optional[int] = ..., free_blocks: _Optional[int] = ..., cached_blocks: _Optional[int] = ..., running: _Optional[int] = ..., waiting: _Optional[int] = ...) -> None: ...

class RegisterRequest(_message.Message):
    __slots__ = ("worker", "held", "load")
    WORKER_FIELD_NUMBER: _ClassVar[int]
    HELD_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    worker: WorkerInfo
    held: _containers.RepeatedCompositeFieldContainer[HeldBlockSet]
    load: WorkerLoad
    def __init__(self, worker: _Optional[_Union[WorkerInfo, _Mapping]] = ..., held: _Optional[_Iterable[_Union[HeldBlockSet, _Mapping]]] = ..., load: _Optional[_Union[WorkerLoad, _Mapping]] = ...) -> None: ...

class RegisterResponse(_message.Message):
    __slots__ = ("control_epoch", "lease_seconds", "heartbeat_interval_seconds")
    CONTROL_EPOCH_FIELD_NUMBER: _ClassVar[int]
    LEASE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_INTERVAL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    control_epoch: int
    lease_seconds: float
    heartbeat_interval_seconds: float
    def __init__(self, control_epoch: _Optional[int] = ..., lease_seconds: _Optional[float] = ..., heartbeat_interval_seconds: _Optional[float] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("worker_id", "epoch", "load", "held")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    HELD_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    epoch: int
    load: WorkerLoad
    held: _containers.RepeatedCompositeFieldContainer[HeldBlockSet]
    def __init__(self, worker_id: _Optional[str] = ..., epoch: _Optional[int] = ..., load: _Optional[_Union[WorkerLoad, _Mapping]] = ..., held: _Optional[_Iterable[_Union[HeldBlockSet, _Mapping]]] = ...) -> None: ...

class HeartbeatResponse(_message.Message):
    __slots__ = ("registered", "control_epoch", "release_request_ids")
    REGISTERED_FIELD_NUMBER: _ClassVar[int]
    CONTROL_EPOCH_FIELD_NUMBER: _ClassVar[int]
    RELEASE_REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    registered: bool
    control_epoch: int
    release_request_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, registered: _Optional[bool] = ..., control_epoch: _Optional[int] = ..., release_request_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class EngineRequest(_message.Message):
    __slots__ = ("request_id", "prompt_ids", "sampling", "cache_salt")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _generation_pb2.SamplingParams
    cache_salt: bytes
    def __init__(self, request_id: _Optional[str] = ..., prompt_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_generation_pb2.SamplingParams, _Mapping]] = ..., cache_salt: _Optional[bytes] = ...) -> None: ...

class ColocatedRequest(_message.Message):
    __slots__ = ("request", "prompt")
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    request: EngineRequest
    prompt: _generation_pb2.GenerateRequest
    def __init__(self, request: _Optional[_Union[EngineRequest, _Mapping]] = ..., prompt: _Optional[_Union[_generation_pb2.GenerateRequest, _Mapping]] = ...) -> None: ...

class PrepareRequest(_message.Message):
    __slots__ = ("request",)
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    request: _generation_pb2.GenerateRequest
    def __init__(self, request: _Optional[_Union[_generation_pb2.GenerateRequest, _Mapping]] = ...) -> None: ...

class PrepareResponse(_message.Message):
    __slots__ = ("request",)
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    request: EngineRequest
    def __init__(self, request: _Optional[_Union[EngineRequest, _Mapping]] = ...) -> None: ...

class DetokenizeRequest(_message.Message):
    __slots__ = ("token_ids", "token_strs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_STRS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    token_strs: bool
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., token_strs: _Optional[bool] = ...) -> None: ...

class DetokenizeResponse(_message.Message):
    __slots__ = ("text", "token_strs")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_STRS_FIELD_NUMBER: _ClassVar[int]
    text: str
    token_strs: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, text: _Optional[str] = ..., token_strs: _Optional[_Iterable[str]] = ...) -> None: ...

class ReserveRequest(_message.Message):
    __slots__ = ("request", "prompt", "generation", "lease_seconds")
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    LEASE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    request: EngineRequest
    prompt: _generation_pb2.GenerateRequest
    generation: int
    lease_seconds: float
    def __init__(self, request: _Optional[_Union[EngineRequest, _Mapping]] = ..., prompt: _Optional[_Union[_generation_pb2.GenerateRequest, _Mapping]] = ..., generation: _Optional[int] = ..., lease_seconds: _Optional[float] = ...) -> None: ...

class ReserveResponse(_message.Message):
    __slots__ = ("block_ids", "transfer_id", "epoch", "layout", "request")
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    transfer_id: str
    epoch: int
    layout: KVCacheLayout
    request: EngineRequest
    def __init__(self, block_ids: _Optional[_Iterable[int]] = ..., transfer_id: _Optional[str] = ..., epoch: _Optional[int] = ..., layout: _Optional[_Union[KVCacheLayout, _Mapping]] = ..., request: _Optional[_Union[EngineRequest, _Mapping]] = ...) -> None: ...

class KVTarget(_message.Message):
    __slots__ = ("worker_id", "epoch", "generation", "backend", "endpoint", "block_ids", "transfer_id", "layout")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    epoch: int
    generation: int
    backend: str
    endpoint: str
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    transfer_id: str
    layout: KVCacheLayout
    def __init__(self, worker_id: _Optional[str] = ..., epoch: _Optional[int] = ..., generation: _Optional[int] = ..., backend: _Optional[str] = ..., endpoint: _Optional[str] = ..., block_ids: _Optional[_Iterable[int]] = ..., transfer_id: _Optional[str] = ..., layout: _Optional[_Union[KVCacheLayout, _Mapping]] = ...) -> None: ...

class FirstToken(_message.Message):
    __slots__ = ("index", "token_id", "logprobs")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    index: int
    token_id: int
    logprobs: _generation_pb2.TokenLogprobs
    def __init__(self, index: _Optional[int] = ..., token_id: _Optional[int] = ..., logprobs: _Optional[_Union[_generation_pb2.TokenLogprobs, _Mapping]] = ...) -> None: ...

class FirstTokens(_message.Message):
    __slots__ = ("tokens",)
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    tokens: _containers.RepeatedCompositeFieldContainer[FirstToken]
    def __init__(self, tokens: _Optional[_Iterable[_Union[FirstToken, _Mapping]]] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("request", "target", "prompt", "generation")
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    TARGET_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    request: EngineRequest
    target: KVTarget
    prompt: _generation_pb2.GenerateRequest
    generation: int
    def __init__(self, request: _Optional[_Union[EngineRequest, _Mapping]] = ..., target: _Optional[_Union[KVTarget, _Mapping]] = ..., prompt: _Optional[_Union[_generation_pb2.GenerateRequest, _Mapping]] = ..., generation: _Optional[int] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("first_tokens", "cached_tokens", "queue_seconds", "prefill_seconds", "transfer_seconds", "transfer_bytes", "prompt_logprobs", "prompt_text")
    FIRST_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_BYTES_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TEXT_FIELD_NUMBER: _ClassVar[int]
    first_tokens: _containers.RepeatedCompositeFieldContainer[FirstToken]
    cached_tokens: int
    queue_seconds: float
    prefill_seconds: float
    transfer_seconds: float
    transfer_bytes: int
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[_generation_pb2.TokenLogprobs]
    prompt_text: str
    def __init__(self, first_tokens: _Optional[_Iterable[_Union[FirstToken, _Mapping]]] = ..., cached_tokens: _Optional[int] = ..., queue_seconds: _Optional[float] = ..., prefill_seconds: _Optional[float] = ..., transfer_seconds: _Optional[float] = ..., transfer_bytes: _Optional[int] = ..., prompt_logprobs: _Optional[_Iterable[_Union[_generation_pb2.TokenLogprobs, _Mapping]]] = ..., prompt_text: _Optional[str] = ...) -> None: ...

class DecodeRequest(_message.Message):
    __slots__ = ("request_id", "epoch", "generation", "transfer_id")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    epoch: int
    generation: int
    transfer_id: str
    def __init__(self, request_id: _Optional[str] = ..., epoch: _Optional[int] = ..., generation: _Optional[int] = ..., transfer_id: _Optional[str] = ...) -> None: ...

class DecodeResponse(_message.Message):
    __slots__ = ("index", "token_ids", "text", "logprobs", "finish_reason", "stop_token_id", "stop_string", "completion_tokens", "cached_tokens", "first_decode_seconds", "queue_seconds", "prefill_seconds", "prompt_tokens", "prompt_logprobs", "prompt_text")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    STOP_STRING_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FIRST_DECODE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TEXT_FIELD_NUMBER: _ClassVar[int]
    index: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    logprobs: _containers.RepeatedCompositeFieldContainer[_generation_pb2.TokenLogprobs]
    finish_reason: _generation_pb2.FinishReason
    stop_token_id: int
    stop_string: str
    completion_tokens: int
    cached_tokens: int
    first_decode_seconds: float
    queue_seconds: float
    prefill_seconds: float
    prompt_tokens: int
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[_generation_pb2.TokenLogprobs]
    prompt_text: str
    def __init__(self, index: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., logprobs: _Optional[_Iterable[_Union[_generation_pb2.TokenLogprobs, _Mapping]]] = ..., finish_reason: _Optional[_Union[_generation_pb2.FinishReason, str]] = ..., stop_token_id: _Optional[int] = ..., stop_string: _Optional[str] = ..., completion_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., first_decode_seconds: _Optional[float] = ..., queue_seconds: _Optional[float] = ..., prefill_seconds: _Optional[float] = ..., prompt_tokens: _Optional[int] = ..., prompt_logprobs: _Optional[_Iterable[_Union[_generation_pb2.TokenLogprobs, _Mapping]]] = ..., prompt_text: _Optional[str] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("request_id", "generation", "reason")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    generation: int
    reason: str
    def __init__(self, request_id: _Optional[str] = ..., generation: _Optional[int] = ..., reason: _Optional[str] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: bool
    def __init__(self, released: _Optional[bool] = ...) -> None: ...
