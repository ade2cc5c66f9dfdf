"""Cross-host fallback: `KVTransferService/PushFrames`, a client stream of ~2 MiB frames.

`PushFrames` is a raw-bytes method (registered beside the generated service, not declared in
the proto): each stream message is one kv_transfer frame, the fixed 80-byte header
(`kv_transfer.header`) followed by `payload_len` raw bytes, with no protobuf encoding around it.
The sender gathers each frame's blocks straight into a fresh `bytes` message behind its
header (one copy) and hands it to gRPC; the receiver validates the header and fencing, then
scatters straight from the received message into the reserved blocks. BEGIN carries the
destination ids (u32), FRAME the blocks, END and CANCEL nothing; the call returns a protobuf
`PushResult`. `PushBlocksUnary` (the whole block set as ONE protobuf message) remains as the
baseline.

Where the time goes (perf and per-process CPU time, 2-core machine shared with other jobs,
128 MiB in 2 MiB frames, about 135 ms of CPU for both processes together, 150-215 ms before):
- sender (about 45-65 ms): zeroing the fresh message and gathering into it, the xxh3 pass,
  and the kernel's copy into the socket, on the thread that feeds the call. A fresh message
  per frame because grpc may keep a reference to what it sends; joining a staged payload
  behind the header cost one more copy.
- receiver (about 70 ms): the kernel's copy out of the socket (grpc's threads), then on the
  event loop thread grpc's copies of the message's slices into one `bytes` (not avoidable
  through grpc's Python API), the xxh3 pass and the scatter into the cache. Up to a third of
  the receiver's samples are page faults zeroing grpc's read buffers (its threads' arenas
  unmap them after every frame).
- measured and not kept: one glibc arena for the process (no faults, but no measurable gain,
  and it changes every allocation of the worker), 512 KiB frames (more CPU per byte; 1 to 7
  MiB alike, 2 MiB stays), HTTP/2 frame size, window and BDP options (within noise), and
  verifying and scattering on a worker thread while the loop takes the next message (more
  CPU, no faster on a loaded machine). Not built: several streams in flight (gRPC alone moved
  4.38 GB/s best over one stream, 4.36 over two connections, 3.59 over four, 4.26 over two
  streams on one connection: both processes are CPU-bound on two cores, and the receiver
  handles every stream on its one event loop thread; BENCHMARKS.md).

gRPC alone sets the ceiling: the same bytes through the same kind of call with none of the
work above (`kvmesh bench transfer`'s `grpc_raw` row: no gather, hash or scatter) moved 2.05-
2.25 GB/s where this stream moved 1.17-1.29 GB/s, 0.57-0.60x of it, in the same runs. Timers
in both processes (one run, not kept) put the frames' own work at 44-46 ms per 128 MiB on the
sender (zeroing 5, gathering 21, xxh3 5 when alone on a core) and 47-58 ms on the receiver
(xxh3 5, scatter 18 alone): two copies and two hash passes more than gRPC's own four copies
(its copy of the message into a slice, the two socket copies, its join into `bytes`), on two
cores both processes already keep busy. A worker thread for the receiver's verify and scatter
was measured again on a quiet machine: no gain (0.57-0.58x of gRPC alone).

The receiver runs a `grpc.aio` server (uvloop when installed) on its own thread; the sender
uses a synchronous channel. With a `Security` holding the cluster token, the receiver refuses
every call without it (UNAUTHENTICATED, before any frame is read) and the sender presents it;
with certificates both sides use TLS (mutual TLS with a CA). The call's deadline is the
transfer deadline; cancelling the call cancels the transfer on both sides.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
import threading
import time
import warnings
from collections.abc import Iterator, Sequence

import grpc
import torch

from kv_transfer.blocks import BlockStore
from kv_transfer.errors import (
    DeadlineExpiredError,
    FrameError,
    LayoutMismatchError,
    PeerError,
    TransferCancelledError,
    TransferError,
    error_from_wire,
)
from kv_transfer.header import HEADER_SIZE, FrameHeader, MsgType, decode_header, frame_header
from kv_transfer.heap import keep_frames_in_heap
from kv_transfer.interface import DEFAULT_FRAME_BYTES, KVReceiver, KVSender, SendPlan, Waiter
from kv_transfer.interface import fill_frame as _fill
from kv_transfer.layout import KVLayout
from kv_transfer.state import TransferRecord, TransferState
from kvmesh.security import Security
from kvmesh.v1 import kv_transfer_pb2 as pb
from kvmesh.v1 import kv_transfer_pb2_grpc as pb_grpc
from kvmesh.v1 import wire
from kvmesh.v1.transfer import TransferCode

keep_frames_in_heap()  # before grpc's threads first allocate (see kv_transfer.heap)
HANDSHAKE_SECONDS = 10.0
SERVICE = "kvmesh.v1.KVTransferService"
PUSH_FRAMES = f"/{SERVICE}/PushFrames"


def _header(frame: pb.KVFrame) -> FrameHeader:
    try:
        kind = MsgType(frame.msg_type)
    except ValueError:
        raise FrameError("msg_type", f"unknown message type {frame.msg_type}") from None
    return FrameHeader(
        kind,
        bytes(frame.transfer_id).ljust(16, b"\0")[:16],
        frame.epoch,
        frame.frame_index,
        frame.frame_count,
        frame.block_offset,
        frame.num_blocks,
        frame.payload_len,
        0,
        frame.checksum,
        frame.flags,
    )


def _spend_the_immutable_buffer_warning() -> None:
    """Frames are `bytes`: the receiver only reads them, and the sender fills a fresh one that
    nothing else has seen yet, so torch's warning about immutable buffers does not apply.
    torch gives it once per process: spend it here, silenced, instead of filtering warnings
    around every frame."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.frombuffer(bytes(1), dtype=torch.uint8)


_spend_the_immutable_buffer_warning()


def bytes_tensor(message: bytes, offset: int = 0) -> torch.Tensor:
    """A uint8 view of `message[offset:]` without a copy: read only (the receiver's scatter
    source), or written only by the sender into a message it just created and nothing else
    has seen yet (its one copy); never written when shared or received."""
    return torch.frombuffer(message, dtype=torch.uint8, offset=offset)


class _Servicer(pb_grpc.KVTransferServiceServicer):
    def __init__(self, receiver: Receiver) -> None:
        self.r = receiver

    async def Handshake(self, request: pb.HandshakeRequest, context: grpc.aio.ServicerContext):
        try:
            self.r.layout.check_compatible(KVLayout.from_bytes(request.layout))
        except TransferError as exc:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        return pb.HandshakeReply(layout=self.r.layout.to_bytes())

    async def PushFrames(self, request_iterator, context: grpc.aio.ServicerContext):
        """Raw frames (header + payload bytes) until END; see the module docstring.

        A transfer this stream began never outlives it: a stream that ends without END or
        CANCEL (the sender cancelled the call, or its deadline passed) ends it CANCELLED, one
        that breaks off on an error ends it FAILED, at once rather than at the lease (every
        transfer it began: a stream may begin more than one)."""
        begun: list[FrameHeader] = []
        error: TransferError = TransferCancelledError("the stream ended before END")
        try:
            async for message in request_iterator:
                header = _raw_header(message)
                result = self.r.apply_raw(header, message)
                if result is not None:
                    return result
                if header.msg_type is MsgType.BEGIN:
                    begun.append(header)
            raise error
        except TransferError as exc:
            error = exc
            return pb.PushResult(state="FAILED", error_code=exc.code, message=str(exc))
        except asyncio.CancelledError:  # the sender cancelled the call or its deadline passed
            error = TransferCancelledError("the call was cancelled")
            raise
        except Exception as exc:
            error = PeerError(f"the stream broke off: {type(exc).__name__}")
            raise
        finally:  # a no-op for a transfer already ended (its END or CANCEL)
            for header in begun:
                self.r.core.on_broken_off(header, error)

    async def PushBlocksUnary(self, request: pb.KVFrame, context: grpc.aio.ServicerContext):
        begun: FrameHeader | None = None
        try:
            head = _header(request)
            self.r.core.on_begin(head, _ids_bytes(request.dst_block_ids))
            begun = head
            self.r.apply(request)
            return self.r.apply(
                pb.KVFrame(msg_type=MsgType.END, transfer_id=head.transfer_id, epoch=head.epoch)
            )
        except TransferError as exc:
            if begun is not None:  # the call that began it is over: so is the transfer
                self.r.core.on_broken_off(begun, exc)
            return pb.PushResult(state="FAILED", error_code=exc.code, message=str(exc))


def _raw_header(message: bytes) -> FrameHeader:
    """Decode a raw frame's header; the message must be exactly header + payload_len bytes."""
    if len(message) < HEADER_SIZE:
        raise FrameError("header", f"need {HEADER_SIZE} bytes, got {len(message)}")
    header = decode_header(memoryview(message)[:HEADER_SIZE])
    if len(message) - HEADER_SIZE != header.payload_len:
        raise FrameError("payload_len", f"{header.payload_len} != {len(message) - HEADER_SIZE}")
    return header


def _ids_bytes(ids: Sequence[int]) -> bytes:
    """BEGIN's payload of proto ids (uint32: one beyond int32 reads as another id, refused
    by the reservation check, never an overflow)."""
    return struct.pack(f"<{len(ids)}I", *ids)


class Receiver(KVReceiver):
    def __init__(
        self,
        store: BlockStore,
        *,
        bind: str = "127.0.0.1:0",
        max_message_bytes: int = 8 << 20,
        max_connection_idle_seconds: float = 300.0,
        security: Security | None = None,
    ) -> None:
        super().__init__(store)
        self.security = security or Security()
        self._idle_seconds = max_connection_idle_seconds
        self._loop = new_event_loop()
        self._server: grpc.aio.Server | None = None
        self._close_lock = threading.Lock()
        self._closed = False  # guarded by _close_lock: close() runs once
        self._port, self._bind_error = 0, ""
        self._start_error: Exception | None = None  # set when the server could not be built
        ready = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(bind, max_message_bytes, ready))
        self._thread.daemon = True
        self._thread.start()
        if not ready.wait(HANDSHAKE_SECONDS) or self._port <= 0:
            if self._start_error is not None:  # e.g. TLS files that do not load
                raise self._start_error
            if self._bind_error:  # OSError "--transfer-port: cannot bind ADDRESS: reason"
                raise OSError(self._bind_error)
            raise PeerError(f"gRPC receiver could not bind {bind}")
        host = bind.rsplit(":", 1)[0]
        self._host = socket.getfqdn() if host in ("0.0.0.0", "[::]") else host

    def _run(self, bind: str, max_bytes: int, ready: threading.Event) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._server = self._build_server(max_bytes)
            self._port = self.security.add_port(self._server, bind, field="--transfer-port")
            self._loop.run_until_complete(self._server.start())
        except Exception as error:  # reported by __init__ at once, not after the wait
            self._port = -1
            if isinstance(error, OSError):  # "--transfer-port: cannot bind ADDRESS: reason"
                self._bind_error = str(error)
            else:
                self._start_error = error
            self._loop.close()
            ready.set()
            return
        ready.set()
        try:
            self._loop.run_forever()
        finally:  # stopped by close(): its selector, wake-up pipe and eventfd go with it
            with contextlib.suppress(Exception):
                self._loop.close()

    def _build_server(self, max_bytes: int) -> grpc.aio.Server:
        """The aio server with the KV services and their interceptors (no port yet)."""
        self.auth = self.security.internal_interceptors()
        # The token check first (a refused call is never parsed), then the unary requests'
        # decode check (INVALID_ARGUMENT, not UNKNOWN); PushFrames is raw bytes either way.
        interceptors = [*self.auth, wire.DecodeCheck()]
        server = grpc.aio.server(  # keepalive, idle bound, no SO_REUSEPORT (wire's)
            options=wire.server_options(max_bytes, self._idle_seconds),
            interceptors=interceptors,
        )
        servicer = _Servicer(self)
        pb_grpc.add_KVTransferServiceServicer_to_server(servicer, server)
        raw = grpc.stream_unary_rpc_method_handler(  # bytes in (no deserializer), PushResult out
            servicer.PushFrames, response_serializer=pb.PushResult.SerializeToString
        )
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(SERVICE, {"PushFrames": raw}),)
        )
        return server

    @property
    def address(self) -> str:
        return f"{self._host}:{self._port}"

    def apply(self, frame: pb.KVFrame) -> pb.PushResult | None:
        """Apply one frame to the receiver core; a PushResult once the transfer ended."""
        header = _header(frame)
        if header.msg_type is MsgType.BEGIN:
            self.core.on_begin(header, _ids_bytes(frame.dst_block_ids))
        elif header.msg_type is MsgType.FRAME:
            payload = frame.payload
            data = bytes_tensor(payload) if payload else torch.empty(0, dtype=torch.uint8)
            self.core.on_frame(header, data)
        elif header.msg_type is MsgType.END:
            result = self.core.on_end(header, frame.payload)
            return pb.PushResult(state=result.state.name, num_bytes=result.num_bytes)
        elif header.msg_type is MsgType.CANCEL:
            self.core.on_cancel(header)
            return pb.PushResult(state="CANCELLED", error_code=TransferCode.CANCELLED)
        return None

    def apply_raw(self, header: FrameHeader, message: bytes) -> pb.PushResult | None:
        """Apply one raw frame (validated header + payload after it); a PushResult at the end.

        The receiver core checks fencing (transfer id, epoch, state) and the frame's fields
        before any payload byte is verified or written into the reserved blocks."""
        kind = header.msg_type
        if kind is MsgType.FRAME:
            payload = (
                bytes_tensor(message, HEADER_SIZE)
                if header.payload_len
                else torch.empty(0, dtype=torch.uint8)
            )
            self.core.on_frame(header, payload)
            return None
        body = memoryview(message)[HEADER_SIZE:]
        if header.payload_len:
            header.verify_payload(body)
        if kind is MsgType.BEGIN:
            self.core.on_begin(header, body)
        elif kind is MsgType.END:
            result = self.core.on_end(header, body)
            return pb.PushResult(state=result.state.name, num_bytes=result.num_bytes)
        elif kind is MsgType.CANCEL:
            self.core.on_cancel(header)
            return pb.PushResult(state="CANCELLED", error_code=TransferCode.CANCELLED)
        else:
            raise FrameError("msg_type", f"unexpected {kind.name}")
        return None

    def close(self) -> None:
        """Stop the server (calls under way are cancelled: their transfers end) and its
        loop, whose descriptors are closed. Idempotent: a second call, or one racing the
        first, returns at once (a stopped loop would never run a second stop)."""
        with self._close_lock:
            closed, self._closed = self._closed, True
        if closed:
            return
        if self._server is not None:
            fut = asyncio.run_coroutine_threadsafe(self._server.stop(0.5), self._loop)
            with contextlib.suppress(Exception):
                fut.result(5)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)


def new_event_loop() -> asyncio.AbstractEventLoop:
    """A uvloop event loop when uvloop is installed, else asyncio's."""
    try:
        import uvloop

        return uvloop.new_event_loop()
    except ImportError:
        return asyncio.new_event_loop()


class Sender(KVSender):
    def __init__(
        self,
        store: BlockStore,
        address: str,
        *,
        frame_bytes: int = DEFAULT_FRAME_BYTES,
        max_message_bytes: int = 8 << 20,
        security: Security | None = None,
        connect_deadline: float | None = None,
    ) -> None:
        """The handshake ends by `connect_deadline` (monotonic), at most HANDSHAKE_SECONDS
        after the start."""
        super().__init__(store, frame_bytes)
        self.checksum = True  # the bytes cross a network: every payload is hashed
        security = security or Security()
        self._metadata = security.call_metadata()
        self._channel = security.channel(address, wire.client_options(max_message_bytes))
        self._stub = pb_grpc.KVTransferServiceStub(self._channel)
        self._push = self._channel.stream_unary(  # raw bytes out (no serializer)
            PUSH_FRAMES, request_serializer=None, response_deserializer=pb.PushResult.FromString
        )
        request = pb.HandshakeRequest(layout=self.layout.to_bytes())
        timeout = HANDSHAKE_SECONDS
        if connect_deadline is not None:
            timeout = max(0.001, min(timeout, connect_deadline - time.monotonic()))
        try:
            reply = self._stub.Handshake(request, timeout=timeout, metadata=self._metadata)
        except grpc.RpcError as exc:
            reply = _handshake_refused(exc)
        self.layout.check_compatible(KVLayout.from_bytes(reply.layout))

    def close(self) -> None:
        self._channel.close()

    def _frames(self, plan: SendPlan, waiter: Waiter) -> Iterator[bytes]:
        """Raw messages: header + payload, one `bytes` each (the only copy after the gather)."""
        tid, epoch = plan.request.transfer_id, plan.request.epoch
        begin = plan.begin_payload()
        yield frame_header(MsgType.BEGIN, tid, epoch, begin).encode() + begin
        cancel = waiter.cancel
        for index in plan.iter_frames(waiter):
            if cancel.is_set():
                yield frame_header(MsgType.CANCEL, tid, epoch).encode()
                return
            yield self._message(plan, index)
        if cancel.is_set() or time.monotonic() >= waiter.deadline:  # a streamed plan stopped
            yield frame_header(MsgType.CANCEL, tid, epoch).encode()
            return
        end, trailer = plan.end_frame()
        yield end.encode() + trailer

    def _message(self, plan: SendPlan, index: int) -> bytes:
        """Frame `index` as one fresh message, header then payload, the blocks gathered
        straight into it (one copy). Fresh per frame: grpc may keep what it was handed."""
        n = plan.frames[index][1]
        message = bytes(HEADER_SIZE + n * self.layout.bytes_per_block)
        view = bytes_tensor(message)  # uint8 [HEADER_SIZE + payload]
        header, _ = _fill(self.store, plan, index, view[HEADER_SIZE:], self.checksum)
        view[:HEADER_SIZE].numpy()[:] = memoryview(header.encode())
        return message

    def _transfer(self, plan: SendPlan, record: TransferRecord, waiter: Waiter) -> None:
        left = waiter.check()
        call = self._push.future(self._frames(plan, waiter), timeout=left, metadata=self._metadata)
        done = threading.Event()
        call.add_done_callback(lambda _: done.set())
        cancel_at: float | None = None
        while not done.wait(0.05):
            if waiter.cancel.is_set():
                # a streamed plan's iterator wakes and sends CANCEL in-band; give it a moment
                grace = 1.0 if plan.parts is not None else 0.0
                cancel_at = cancel_at or time.monotonic() + grace
                if time.monotonic() >= cancel_at:
                    call.cancel()
        if plan.parts is not None:  # grpc's thread may still wait in the frames' iterator
            plan.parts.abandon()
        try:
            result = call.result()
        except grpc.FutureCancelledError:
            raise TransferCancelledError("cancelled by the sender") from None
        except grpc.RpcError as exc:
            raise _rpc_error(exc, waiter) from None
        _raise_for(result)

    def send_unary(self, plan: SendPlan, deadline: float) -> pb.PushResult:
        """The whole block set as ONE message (baseline for the stream; needs a large limit)."""
        buf = torch.empty(int(plan.src.numel()) * self.layout.bytes_per_block, dtype=torch.uint8)
        whole = SendPlan(plan.request, plan.src, plan.dst, [(0, int(plan.src.numel()))])
        header, payload = _fill(self.store, whole, 0, buf, self.checksum)
        frame = _to_proto(header, payload.numpy().tobytes())
        frame.dst_block_ids.extend(plan.dst.tolist())
        result = self._stub.PushBlocksUnary(
            frame, timeout=deadline - time.monotonic(), metadata=self._metadata
        )
        _raise_for(result)
        return result


def _to_proto(header: FrameHeader, payload: bytes) -> pb.KVFrame:
    return pb.KVFrame(
        msg_type=header.msg_type,
        transfer_id=header.transfer_id,
        epoch=header.epoch,
        frame_index=header.frame_index,
        frame_count=header.frame_count,
        block_offset=header.block_offset,
        num_blocks=header.num_blocks,
        payload_len=header.payload_len,
        checksum=header.checksum,
        flags=header.flags,
        payload=payload,
    )


def _raise_for(result: pb.PushResult) -> None:
    if result.state != TransferState.COMPLETED.name:
        raise error_from_wire(
            result.error_code or TransferCode.PEER, result.message or result.state
        )


def _rpc_error(exc: grpc.RpcError, waiter: Waiter) -> TransferError:
    code = exc.code() if isinstance(exc, grpc.Call) else None
    if code is grpc.StatusCode.CANCELLED and waiter.cancel.is_set():
        return TransferCancelledError("cancelled by the sender")
    if code is grpc.StatusCode.DEADLINE_EXCEEDED:
        return DeadlineExpiredError("gRPC deadline exceeded")
    return PeerError(f"gRPC {code}: {exc}")


def _handshake_refused(exc: grpc.RpcError) -> pb.HandshakeReply:
    if isinstance(exc, grpc.Call) and exc.code() is grpc.StatusCode.FAILED_PRECONDITION:
        raise LayoutMismatchError("layout", "ours", exc.details())
    if isinstance(exc, grpc.Call) and exc.code() is grpc.StatusCode.UNAUTHENTICATED:
        raise PeerError(f"handshake refused: {exc.details()}")
    raise PeerError(f"handshake failed: {exc}")
