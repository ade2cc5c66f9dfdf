"""Transfer state machine, request and result records.

```
PENDING ──▶ IN_FLIGHT ──▶ COMPLETED
   │            │
   └────────────┴──▶ FAILED | CANCELLED | EXPIRED      (terminal states never change)
```
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import enum
import threading
import time
from collections.abc import Callable

from kv_transfer.errors import (
    DeadlineExpiredError,
    FrameError,
    IllegalTransitionError,
    TransferCancelledError,
    TransferError,
    unraised,
)


class TransferState(enum.Enum):
    PENDING = "pending"
    IN_FLIGHT = "in_flight"
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"
    EXPIRED = "expired"

    @property
    def is_terminal(self) -> bool:
        return self not in (TransferState.PENDING, TransferState.IN_FLIGHT)


_ENDS = {TransferState.FAILED, TransferState.CANCELLED, TransferState.EXPIRED}
LEGAL: dict[TransferState, frozenset[TransferState]] = {
    TransferState.PENDING: frozenset({TransferState.IN_FLIGHT, *_ENDS}),
    TransferState.IN_FLIGHT: frozenset({TransferState.COMPLETED, *_ENDS}),
    **{s: frozenset() for s in (TransferState.COMPLETED, *_ENDS)},
}


@dataclasses.dataclass(frozen=True)
class TransferRequest:
    """Identity of one transfer: a 16-byte id and the epoch the blocks were reserved under."""

    transfer_id: bytes
    epoch: int

    def __post_init__(self) -> None:
        if not isinstance(self.transfer_id, bytes) or len(self.transfer_id) != 16:
            raise FrameError("transfer_id", "must be 16 bytes")
        if not 0 <= self.epoch < 1 << 64:
            raise FrameError("epoch", f"must fit in u64, got {self.epoch}")


@dataclasses.dataclass(frozen=True)
class TransferResult:
    transfer_id: bytes
    state: TransferState
    num_blocks: int
    num_bytes: int
    seconds: float
    error: TransferError | None = None
    trailer: bytes = b""  # the sender's END payload (what the producer handed `finish`)
    kv_complete: bool = True  # False: completed by a FLAG_NO_KV END, the blocks unwritten

    @property
    def ok(self) -> bool:
        return self.state is TransferState.COMPLETED


class TransferRecord:
    """Thread-safe state of one transfer with a condition to wait on."""

    def __init__(self, request: TransferRequest, num_blocks: int, deadline: float) -> None:
        self.request = request
        self.num_blocks = num_blocks
        self.deadline = deadline
        self.started = time.monotonic()
        self.state = TransferState.PENDING
        self.error: TransferError | None = None
        self.num_bytes = 0
        self.trailer = b""
        self.kv_complete = True
        self.ended: float | None = None  # monotonic time it became terminal
        self.lock = threading.RLock()
        self._changed = threading.Condition(self.lock)
        self._on_terminal: list[Callable[[], object]] = []

    def move(self, new: TransferState, error: TransferError | None = None) -> None:
        """Apply a legal transition; raise `IllegalTransitionError` otherwise."""
        with self.lock:
            if new not in LEGAL[self.state]:
                raise IllegalTransitionError(f"{self.state.name} -> {new.name}")
            self.state = new
            self.error = self.error if error is None else unraised(error)  # kept: no frames
            self._changed.notify_all()
            if new.is_terminal:
                self.ended = time.monotonic()
                callbacks, self._on_terminal = self._on_terminal, []
                for callback in callbacks:
                    callback()

    def when_terminal(self, callback: Callable[[], object]) -> None:
        """Call `callback()` once the record is terminal: now when it already is, else on the
        thread that ends it (under the record's lock: it must be quick, e.g. a
        `call_soon_threadsafe`)."""
        with self.lock:
            if not self.state.is_terminal:
                self._on_terminal.append(callback)
                return
        callback()

    async def wait_async(self, timeout: float | None = None) -> TransferResult:
        """`wait` for an event loop: no thread waits; the record's end wakes the loop."""
        loop = asyncio.get_running_loop()
        ended = loop.create_future()

        def wake() -> None:
            if not ended.done():
                ended.set_result(None)

        def post() -> None:
            with contextlib.suppress(RuntimeError):  # the loop closed: nobody waits
                loop.call_soon_threadsafe(wake)

        self.when_terminal(post)
        limit = self.deadline - time.monotonic()
        if timeout is not None:
            limit = min(limit, timeout)
        try:
            async with asyncio.timeout(max(0.0, limit)):
                await ended
        except TimeoutError:
            pass
        return self.wait(0.0)

    def end(self, new: TransferState, error: TransferError | None = None) -> bool:
        """Move to a terminal state unless already terminal; True when this call ended it."""
        with self.lock:
            if self.state.is_terminal:
                return False
            if error is None and new is TransferState.CANCELLED:
                error = TransferCancelledError("cancelled")
            if error is None and new is TransferState.EXPIRED:
                error = DeadlineExpiredError(f"deadline passed in state {self.state.name}")
            self.move(new, error)
            return True

    def expire_if_due(self) -> bool:
        """End as EXPIRED when the deadline has passed; True if the record is (now) terminal."""
        with self.lock:
            if not self.state.is_terminal and time.monotonic() >= self.deadline:
                self.end(TransferState.EXPIRED)
            return self.state.is_terminal

    def wait(self, timeout: float | None = None) -> TransferResult:
        """Wait until terminal or the deadline (expiry ends it as EXPIRED); never unbounded."""
        limit = self.deadline if timeout is None else min(self.deadline, time.monotonic() + timeout)
        with self.lock:
            while not self.state.is_terminal:
                left = limit - time.monotonic()
                if left <= 0:
                    self.expire_if_due()
                    break
                self._changed.wait(min(left, 0.5))
            return self.result()

    def result(self) -> TransferResult:
        """The transfer so far; `seconds` from its start to its end (to now while it runs)."""
        with self.lock:
            end = time.monotonic() if self.ended is None else self.ended
            return TransferResult(
                self.request.transfer_id,
                self.state,
                self.num_blocks,
                self.num_bytes,
                end - self.started,
                self.error,
                self.trailer,
                self.kv_complete,
            )
