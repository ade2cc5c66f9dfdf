"""Typed errors of the memory core; running out of blocks *now* is a return value, not an error."""

from __future__ import annotations


class CapacityError(ValueError):
    """A request needs more blocks than the whole pool holds, so it can never be scheduled."""

    status_name = "RESOURCE_EXHAUSTED"  # the gRPC status it is answered with


class UnknownSequenceError(KeyError):
    """A call named a `seq_id` the block manager does not track."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else "unknown seq_id"


class SequenceExistsError(ValueError):
    """A call that creates a sequence named a `seq_id` that is already tracked."""
