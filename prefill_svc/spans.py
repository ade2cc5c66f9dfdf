"""What the gRPC instrumentation cannot see of a Prefill call: its chunks and its KV transfer.

- `ChunkEvents`: a step hook (engine thread) adding a `prefill_chunk` event to the Prefill
  call's server span for every step that computed prompt tokens of the request.
- `TransferSpan`: the KV transfer's own span, `kv_transfer {backend}`, child of the Prefill
  span, from the sender's start to the receiver's acknowledgement (with overlap it runs beside
  the chunks). Attributes: `kvmesh.transfer.backend`, `.peer` (decode worker), `.blocks`,
  `.bytes`, `.parts` (block sets handed to the sender), `.duration_seconds`, `.state`; status
  ERROR when the transfer did not complete.
"""

from __future__ import annotations

from types import TracebackType
from typing import TYPE_CHECKING

from opentelemetry import trace

from kv_transfer.state import TransferResult
from kvmesh.telemetry.tracing import mark_failed, tracer
from kvmesh.v1 import worker_pb2

if TYPE_CHECKING:
    from kvmesh.engine.disagg import ReadyBlocks

TRACER = tracer("kvmesh.prefill")
PREFIX = "kvmesh.transfer."


class ChunkEvents:
    """Step hook: one `prefill_chunk` event per step that advanced the request's prompt
    (`kvmesh.chunk.index`, `kvmesh.chunk.tokens`, `kvmesh.prefill.computed_tokens`)."""

    def __init__(self, span: trace.Span) -> None:
        self.span = span
        self.computed = 0
        self.chunks = 0
        self.done = False

    def __call__(self, ready: ReadyBlocks) -> None:
        """Record the progress `ready` (the engine's KV connector's report of one step) shows."""
        if self.done:
            return
        computed = ready.computed_tokens
        if computed > self.computed:
            self.span.add_event(
                "prefill_chunk",
                {
                    "kvmesh.chunk.index": self.chunks,
                    "kvmesh.chunk.tokens": computed - self.computed,
                    "kvmesh.prefill.computed_tokens": computed,
                },
            )
            self.chunks += 1
            self.computed = computed
        self.done = ready.prefilled


class TransferSpan:
    """`with TransferSpan(target, blocks) as transfer:` around one KV transfer; call
    `transfer.settled(result)` once the sender's result is known. An exception leaving the
    block marks the span failed only when the transfer had not settled (its end state is the
    span's `error.type`, never the error raised because of it)."""

    def __init__(self, target: worker_pb2.KVTarget, num_blocks: int) -> None:
        attributes: dict[str, str | int] = {
            PREFIX + "backend": target.backend,
            PREFIX + "peer": target.worker_id,
            PREFIX + "blocks": num_blocks,
        }
        self.span = TRACER.start_span(f"kv_transfer {target.backend}", attributes=attributes)
        self.parts = 1
        self.ended = False  # settled: the span's status is the transfer's end state

    def __enter__(self) -> TransferSpan:
        return self

    def settled(self, result: TransferResult) -> None:
        self.span.set_attributes(
            {
                PREFIX + "bytes": result.num_bytes,
                PREFIX + "duration_seconds": result.seconds,
                PREFIX + "state": result.state.name,
            }
        )
        if not result.ok:
            error = str(result.error) if result.error else result.state.name
            mark_failed(self.span, result.state.name, error)
        self.ended = True

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.span.set_attribute(PREFIX + "parts", self.parts)
        if error is not None and not self.ended:  # not the failure raised for its end state
            self.span.record_exception(error)
            mark_failed(self.span, type(error).__name__, str(error))
        self.span.end()
