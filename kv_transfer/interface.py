"""The transfer interface every backend implements.

Sender: `send(request, src_block_ids, dst_block_ids, *, deadline) -> TransferResult`, or
`start(...)` for a cancellable `SendHandle`. Receiver: `expect(request, dst_block_ids, deadline)`
reserves destination blocks and returns a `ReceiveHandle`; `address` is what senders connect to.
Deadlines are absolute `time.monotonic()` values of the calling process.
"""

from __future__ import annotations

import abc
import dataclasses
import threading
import time

import torch

from kv_transfer.blocks import BlockStore, as_ids, frames_for
from kv_transfer.errors import (
    DeadlineExpiredError,
    TransferCancelledError,
    TransferError,
)
from kv_transfer.header import FLAG_NO_CHECKSUM, FrameHeader, MsgType, frame_header
from kv_transfer.receiver_core import ReceiveHandle, ReceiverCore
from kv_transfer.state import TransferRecord, TransferRequest, TransferResult, TransferState

DEFAULT_FRAME_BYTES = 2 << 20


@dataclasses.dataclass(frozen=True)
class SendPlan:
    request: TransferRequest
    src: torch.Tensor  # int64 [n] source block ids
    dst: torch.Tensor  # int64 [n] destination block ids (reserved by the receiver)
    frames: list[tuple[int, int]]  # (block_offset, num_blocks) per frame

    def begin_payload(self) -> bytes:
        return self.dst.to(torch.int32).numpy().tobytes()


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


class KVSender(abc.ABC):
    """Sends block sets from a local `BlockStore` to one receiver address."""

    def __init__(self, store: BlockStore, frame_bytes: int = DEFAULT_FRAME_BYTES) -> None:
        self.store = store
        self.layout = store.layout
        self.frame_bytes = frame_bytes
        self._active: dict[bytes, threading.Event] = {}

    def plan(self, request: TransferRequest, src_ids: object, dst_ids: object) -> SendPlan:
        src, dst = as_ids(src_ids, "src_block_ids"), as_ids(dst_ids, "dst_block_ids")
        self.store.check_ids(src, "src_block_ids")
        if src.numel() != dst.numel():
            raise TransferError(f"{src.numel()} source blocks but {dst.numel()} destinations")
        frames = frames_for(int(src.numel()), self.layout.bytes_per_block, self.frame_bytes)
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
        handle.thread = threading.Thread(
            target=self._drive, args=(plan, record, handle._cancel), daemon=True
        )
        handle.thread.start()
        return handle

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
            record.num_bytes = int(plan.src.numel()) * self.layout.bytes_per_block
            record.move(TransferState.COMPLETED)
        except TransferError as exc:
            record.end(end_state_for(exc), exc)
        except Exception as exc:  # transport failure of any kind ends the transfer FAILED
            record.end(TransferState.FAILED, TransferError(f"{type(exc).__name__}: {exc}"))
        finally:
            self._active.pop(plan.request.transfer_id, None)

    @abc.abstractmethod
    def _transfer(self, plan: SendPlan, record: TransferRecord, waiter: Waiter) -> None:
        """Run the wire protocol; return only when the receiver reported DONE."""

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
    header = frame_header(
        MsgType.FRAME,
        plan.request.transfer_id,
        plan.request.epoch,
        payload.numpy() if checksum else b"",
        frame_index=index,
        frame_count=len(plan.frames),
        block_offset=offset,
        num_blocks=n,
    )
    if not checksum:
        header = dataclasses.replace(header, payload_len=size, flags=FLAG_NO_CHECKSUM)
    return header, payload
