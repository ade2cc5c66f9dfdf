"""The transfer interface every backend implements.

Sender: `send(request, src_block_ids, dst_block_ids, *, deadline) -> TransferResult`, or
`start(...)` for a cancellable `SendHandle`, or `start_stream(request, dst_block_ids, deadline=...)`
for a `StreamSendHandle` whose source blocks are added in parts as they become final (`add`,
then `finish`): the transfer begins at once (a backend whose opening message waits for an
answer sends it on the caller's thread, `KVSender._open`) and each part's frames go out as soon
as they are added, so a producer (the prefill engine) overlaps its compute with the send. Receiver:
`expect(request, dst_block_ids, deadline)` reserves destination blocks and returns a
`ReceiveHandle`; `address` is what senders connect to.
Deadlines are absolute `time.monotonic()` values of the calling process.
"""

from __future__ import annotations

import abc
import dataclasses
import threading
import time
from collections.abc import Iterator

import torch

from kv_transfer.blocks import BlockStore, as_ids, frames_for
from kv_transfer.errors import (
    DeadlineExpiredError,
    TransferCancelledError,
    TransferError,
)
from kv_transfer.header import (
    FLAG_NO_CHECKSUM,
    FLAG_NO_KV,
    MAX_TRAILER,
    FrameHeader,
    MsgType,
    frame_header,
)
from kv_transfer.receiver_core import ReceiveHandle, ReceiverCore
from kv_transfer.state import TransferRecord, TransferRequest, TransferResult, TransferState

DEFAULT_FRAME_BYTES = 2 << 20


@dataclasses.dataclass(frozen=True)
class SendPlan:
    request: TransferRequest
    src: torch.Tensor  # int64 [n] source block ids
    dst: torch.Tensor  # int64 [n] destination block ids (reserved by the receiver)
    frames: list[tuple[int, int]]  # (block_offset, num_blocks) per frame
    parts: PartFeed | None = None  # streamed: frames appear as parts are added

    def begin_payload(self) -> bytes:
        return self.dst.to(torch.int32).numpy().tobytes()

    def end_frame(self) -> tuple[FrameHeader, bytes]:
        """The END header and its payload, the producer's trailer (FLAG_NO_KV when the
        producer finished without KV to ship)."""
        trailer, kv = (b"", True) if self.parts is None else (self.parts.trailer, self.parts.kv)
        header = frame_header(MsgType.END, self.request.transfer_id, self.request.epoch, trailer)
        if not kv:
            header = dataclasses.replace(header, flags=header.flags | FLAG_NO_KV)
        return header, trailer

    @property
    def frame_count(self) -> int:
        """Frames in the transfer; for a streamed one an upper bound (one per block)."""
        return len(self.frames) if self.parts is None else int(self.dst.numel())

    def iter_frames(self, waiter: Waiter) -> Iterator[int]:
        """Frame indices in sending order. A streamed plan waits (bounded by the transfer's
        deadline and cancellation) for parts; it stops early on cancel or expiry, and callers
        check the waiter before END."""
        if self.parts is None:
            yield from range(len(self.frames))
        else:
            yield from self.parts.indices(waiter)


class PartFeed:
    """Source blocks of a streamed transfer, added in parts from any thread (never blocks).

    Bounded by construction: every destination block is added at most once, so the frame list
    never grows past the block count."""

    def __init__(self, plan_src: torch.Tensor, frames: list[tuple[int, int]], per: int) -> None:
        self._src = plan_src
        self._frames = frames
        self._per = per
        self._added = torch.zeros(int(plan_src.numel()), dtype=torch.bool)
        self._num_added = 0
        self._finished = False
        self._abandoned = False  # the transfer ended: no frame is read any more
        self._cond = threading.Condition()
        self.trailer = b""
        self.kv = True

    @property
    def num_added(self) -> int:
        return self._num_added

    def add(self, block_offset: int, src_ids: torch.Tensor) -> None:
        n = int(src_ids.numel())
        total = int(self._src.numel())
        with self._cond:
            if self._finished:
                raise TransferError("part added after finish()")
            if n == 0:
                return
            if block_offset < 0 or block_offset + n > total:
                raise TransferError(f"part {block_offset}+{n} outside the {total} blocks")
            if bool(self._added[block_offset : block_offset + n].any()):
                raise TransferError(f"part {block_offset}+{n} overlaps blocks already added")
            self._src[block_offset : block_offset + n] = src_ids
            self._added[block_offset : block_offset + n] = True
            self._num_added += n
            for off in range(0, n, self._per):
                self._frames.append((block_offset + off, min(self._per, n - off)))
            self._cond.notify_all()

    def finish(self, trailer: bytes = b"", *, kv: bool = True) -> None:
        """No more parts; `trailer` (at most MAX_TRAILER bytes) travels in END. `kv=False`:
        the producer has no (more) KV to ship, and END completes the transfer as it is."""
        if len(trailer) > MAX_TRAILER:
            raise TransferError(f"trailer of {len(trailer)} bytes above {MAX_TRAILER}")
        with self._cond:
            if kv and self._num_added != int(self._src.numel()):
                raise TransferError(
                    f"finish() with {self._num_added} of {int(self._src.numel())} blocks added"
                )
            self.trailer, self.kv = bytes(trailer), kv
            self._finished = True
            self._cond.notify_all()

    def abandon(self) -> None:
        """The transfer ended (its call refused or failed): `indices` stops at once, and
        no part added later is read (its source blocks may be freed by then)."""
        with self._cond:
            self._abandoned = True
            self._cond.notify_all()

    def indices(self, waiter: Waiter) -> Iterator[int]:
        sent = 0
        while True:
            with self._cond:
                while sent == len(self._frames) and not (self._finished or self._abandoned):
                    if waiter.cancel.is_set() or time.monotonic() >= waiter.deadline:
                        return
                    self._cond.wait(0.05)
                if self._abandoned:
                    return
                available = len(self._frames)
                done = self._finished and sent == available
            if done:
                return
            while sent < available and not self._abandoned:
                yield sent
                sent += 1


class SendHandle:
    """A transfer running in a background thread: `wait()` for the result, `cancel()` it."""

    def __init__(self, record: TransferRecord, cancel: threading.Event) -> None:
        self.record = record
        self._cancel = cancel
        self.thread: threading.Thread | None = None

    def cancel(self) -> None:
        self._cancel.set()

    def wait(self, timeout: float | None = None) -> TransferResult:
        return self.record.wait(timeout)

    async def wait_async(self, timeout: float | None = None) -> TransferResult:
        """`wait` on an event loop, without a waiting thread."""
        return await self.record.wait_async(timeout)


class StreamSendHandle(SendHandle):
    """A streamed transfer: `add(block_offset, src_block_ids)` parts as they become final (any
    order, each block once, never blocks), then `finish()`; the receiver acknowledges once,
    after the last block."""

    def __init__(self, record: TransferRecord, cancel: threading.Event, feed: PartFeed) -> None:
        super().__init__(record, cancel)
        self.feed = feed

    def add(self, block_offset: int, src_block_ids: object) -> None:
        self.feed.add(block_offset, as_ids(src_block_ids, "src_block_ids"))

    def finish(self, trailer: bytes = b"", *, kv: bool = True) -> None:
        """Every part was added (or, `kv=False`, none will be); `trailer` travels in END and
        reaches the receiver's `TransferResult.trailer`."""
        self.feed.finish(trailer, kv=kv)


class KVSender(abc.ABC):
    """Sends block sets from a local `BlockStore` to one receiver address."""

    def __init__(self, store: BlockStore, frame_bytes: int = DEFAULT_FRAME_BYTES) -> None:
        self.store = store
        self.layout = store.layout
        self.frame_bytes = frame_bytes
        self._active: dict[bytes, threading.Event] = {}

    @property
    def blocks_per_frame(self) -> int:
        """Whole blocks in one frame of at most frame_bytes (a larger block travels alone)."""
        return max(1, self.frame_bytes // self.layout.bytes_per_block)

    @property
    def max_frame_bytes(self) -> int:
        """Bytes of the largest frame this sender sends (the size of a staging buffer)."""
        return self.blocks_per_frame * self.layout.bytes_per_block

    def plan(self, request: TransferRequest, src_ids: object, dst_ids: object) -> SendPlan:
        src, dst = as_ids(src_ids, "src_block_ids"), as_ids(dst_ids, "dst_block_ids")
        self.store.check_ids(src, "src_block_ids")
        if src.numel() != dst.numel():
            raise TransferError(f"{src.numel()} source blocks but {dst.numel()} destinations")
        frames = frames_for(int(src.numel()), self.layout.bytes_per_block, self.max_frame_bytes)
        return SendPlan(request, src, dst, frames)

    def start(
        self,
        request: TransferRequest,
        src_block_ids: object,
        dst_block_ids: object,
        *,
        deadline: float,
    ) -> SendHandle:
        """Begin a transfer in a background thread; returns at once."""
        plan = self.plan(request, src_block_ids, dst_block_ids)
        record = TransferRecord(request, int(plan.src.numel()), deadline)
        handle = SendHandle(record, threading.Event())
        self._launch(plan, handle)
        return handle

    def start_stream(
        self, request: TransferRequest, dst_block_ids: object, *, deadline: float
    ) -> StreamSendHandle:
        """Begin a transfer into `dst_block_ids` whose source blocks come later, in parts."""
        dst = as_ids(dst_block_ids, "dst_block_ids")
        src = torch.full_like(dst, -1)
        frames: list[tuple[int, int]] = []
        feed = _CheckedFeed(self.store, src, frames, self.blocks_per_frame)
        plan = SendPlan(request, src, dst, frames, feed)
        record = TransferRecord(request, int(dst.numel()), deadline)
        handle = StreamSendHandle(record, threading.Event(), feed)
        self._launch(plan, handle)
        return handle

    def _launch(self, plan: SendPlan, handle: SendHandle) -> None:
        """Open the transfer on the caller's thread (`_open`), then run it in a new thread."""
        self._open(plan)
        handle.thread = threading.Thread(
            target=self._drive, args=(plan, handle.record, handle._cancel), daemon=True
        )
        handle.thread.start()

    def _open(self, plan: SendPlan) -> None:  # noqa: B027 - optional hook
        """Send the transfer's opening message now, on the caller's thread, if the backend can
        without blocking: the receiver's answer is then on its way before the transfer thread
        first runs (which may wait for the GIL while the caller's engine computes). Never
        raises, never blocks; what it did not send, the transfer thread sends as before."""

    def send(
        self,
        request: TransferRequest,
        src_block_ids: object,
        dst_block_ids: object,
        *,
        deadline: float,
    ) -> TransferResult:
        """Move blocks `src_block_ids` into the receiver's reserved `dst_block_ids`."""
        plan = self.plan(request, src_block_ids, dst_block_ids)
        record = TransferRecord(request, int(plan.src.numel()), deadline)
        self._drive(plan, record, threading.Event())
        return record.result()

    def cancel(self, transfer_id: bytes) -> bool:
        """Cancel an in-flight transfer of this sender; False when none is running."""
        event = self._active.get(transfer_id)
        if event is not None:
            event.set()
        return event is not None

    def _drive(self, plan: SendPlan, record: TransferRecord, cancel: threading.Event) -> None:
        self._active[plan.request.transfer_id] = cancel
        try:
            record.move(TransferState.IN_FLIGHT)
            self._transfer(plan, record, Waiter(record.deadline, cancel))
            blocks = plan.src.numel() if plan.parts is None else plan.parts.num_added
            record.num_bytes = int(blocks) * self.layout.bytes_per_block
            record.move(TransferState.COMPLETED)
        except TransferError as exc:
            record.end(end_state_for(exc), exc)  # kept as an unraised copy
        except Exception as exc:  # transport failure of any kind ends the transfer FAILED
            record.end(TransferState.FAILED, TransferError(f"{type(exc).__name__}: {exc}"))
        finally:
            self._active.pop(plan.request.transfer_id, None)

    @abc.abstractmethod
    def _transfer(self, plan: SendPlan, record: TransferRecord, waiter: Waiter) -> None:
        """Run the wire protocol; return only when the receiver reported DONE."""

    @property
    def stale(self) -> bool:
        """True when this idle sender's peer is gone (a pool then closes it)."""
        return False

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release connections and staging buffers."""


class KVReceiver(abc.ABC):
    """Accepts transfers into a local `BlockStore` for reserved destination blocks."""

    def __init__(self, store: BlockStore) -> None:
        self.store = store
        self.layout = store.layout
        self.core = ReceiverCore(store)

    @property
    @abc.abstractmethod
    def address(self) -> str:
        """Where senders connect."""

    def expect(
        self, request: TransferRequest, dst_block_ids: object, deadline: float
    ) -> ReceiveHandle:
        return self.core.expect(request, dst_block_ids, deadline)

    def close(self) -> None:  # noqa: B027 - optional hook
        """Stop accepting and release resources."""


class _CheckedFeed(PartFeed):
    def __init__(
        self, store: BlockStore, src: torch.Tensor, frames: list[tuple[int, int]], per: int
    ) -> None:
        super().__init__(src, frames, per)
        self._store = store

    def add(self, block_offset: int, src_ids: torch.Tensor) -> None:
        self._store.check_ids(src_ids, "src_block_ids")
        super().add(block_offset, src_ids)


class Waiter:
    """Deadline and cancellation checks for one transfer's waits."""

    def __init__(self, deadline: float, cancel: threading.Event) -> None:
        self.deadline = deadline
        self.cancel = cancel

    def check(self) -> float:
        """Raise when cancelled or past the deadline; return seconds left."""
        if self.cancel.is_set():
            raise TransferCancelledError("cancelled by the sender")
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise DeadlineExpiredError("deadline passed while sending")
        return left


def end_state_for(error: TransferError) -> TransferState:
    if isinstance(error, TransferCancelledError):
        return TransferState.CANCELLED
    if isinstance(error, DeadlineExpiredError):
        return TransferState.EXPIRED
    return TransferState.FAILED


def fill_frame(
    store: BlockStore, plan: SendPlan, index: int, buf: torch.Tensor, checksum: bool = True
) -> tuple[FrameHeader, torch.Tensor]:
    """Gather frame `index` into uint8 `buf`; return (header, payload view)."""
    offset, n = plan.frames[index]
    size = store.gather_into(plan.src[offset : offset + n], buf)
    payload = buf[:size]
    return payload_header(plan, index, payload, checksum), payload


def payload_header(
    plan: SendPlan, index: int, payload: torch.Tensor, checksum: bool = True
) -> FrameHeader:
    """The FRAME header of frame `index` whose payload (uint8 [payload_len]) is `payload`."""
    offset, n = plan.frames[index]
    header = frame_header(
        MsgType.FRAME,
        plan.request.transfer_id,
        plan.request.epoch,
        payload.numpy() if checksum else b"",
        frame_index=index,
        frame_count=plan.frame_count,
        block_offset=offset,
        num_blocks=n,
    )
    if not checksum:
        size = int(payload.numel())
        header = dataclasses.replace(header, payload_len=size, flags=FLAG_NO_CHECKSUM)
    return header
