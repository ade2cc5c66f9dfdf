"""Bounded client-side retries of kvmesh calls refused before any response arrived.

A call is retried only when nothing of it reached the client and the server said a retry may help:
RESOURCE_EXHAUSTED that carries a retry delay (the `grpc-retry-pushback-ms` trailer, a
`google.rpc.RetryInfo` detail, or the older `retry-after-ms` trailer: the server's admission was
full), or UNAVAILABLE (no usable worker at that moment, the server restarting or draining), after
a short exponential backoff, or the server's retry delay when it sent a longer one. A negative
delay in any of them means "do not retry", whatever the code (gRPC's pushback rule). Retries are
bounded three ways: their number, their total waiting time, and the call's own deadline (a retry
that could not start before it is not made; each retry gets only the time left).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import grpc

from kvmesh.v1 import wire


@dataclass(frozen=True)
class RetryPolicy:
    """How many retries (0: none), the most time spent waiting between them, and the first
    backoff of an UNAVAILABLE retry (doubled each time)."""

    max_retries: int = 2
    max_wait_seconds: float = 5.0
    unavailable_backoff_seconds: float = 0.1

    def __post_init__(self) -> None:
        if min(self.max_retries, self.max_wait_seconds, self.unavailable_backoff_seconds) < 0:
            raise ValueError("retries, waiting time and backoff must be non-negative")

    def start(self, timeout: float | None) -> Retries:
        """The retry state of one call with this deadline (seconds from now, None: none)."""
        return Retries(self, None if timeout is None else time.monotonic() + timeout)


NO_RETRY = RetryPolicy(max_retries=0)
DEFAULT_RETRY = RetryPolicy()


class Retries:
    """One call's retries: `delay(error)` says how long to wait before the next attempt, or
    None to give up; `timeout()` is the time left for that attempt."""

    def __init__(self, policy: RetryPolicy, deadline: float | None) -> None:
        self.policy, self.deadline = policy, deadline
        self.attempts = 0  # retries granted so far
        self.waited = 0.0

    def timeout(self) -> float | None:
        if self.deadline is None:
            return None
        return max(self.deadline - time.monotonic(), 0.001)

    def delay(self, error: grpc.RpcError) -> float | None:
        """Seconds to wait before retrying the failed call, or None (not retryable, the server
        said "do not retry", or a bound would be passed); a granted retry is counted."""
        policy = self.policy
        if self.attempts >= policy.max_retries:
            return None
        pushback = wire.retry_pushback_ms(error)
        if pushback is not None and pushback < 0:  # "do not retry", whatever the code
            return None
        seconds = self._wait(error.code(), pushback)  # type: ignore[attr-defined]
        if seconds is None or self.waited + seconds > policy.max_wait_seconds:
            return None
        if self.deadline is not None and time.monotonic() + seconds >= self.deadline:
            return None
        self.attempts += 1
        self.waited += seconds
        return seconds

    def _wait(self, code: grpc.StatusCode, pushback: int | None) -> float | None:
        """The wait before the next attempt after `code` with the server's non-negative
        `pushback` (ms, None: none sent), or None when `code` is not retried."""
        if code == grpc.StatusCode.RESOURCE_EXHAUSTED:  # retried only when the server says when
            return None if pushback is None else pushback / 1000
        if code == grpc.StatusCode.UNAVAILABLE:  # a draining server says when to come back
            seconds = self.policy.unavailable_backoff_seconds * 2**self.attempts
            return seconds if pushback is None else max(seconds, pushback / 1000)
        return None
