"""Serving metrics of one run, from the client's records (vLLM's benchmark definitions).

- TTFT: send to the first streamed output. E2E: send to the last.
- TPOT (per request): (E2E - TTFT) / (output tokens - 1), requests of more than one token.
- ITL: every gap between consecutive streamed outputs, all requests pooled.
- Throughput over the run's duration (first send to last answer): requests/s, output tokens/s,
  total (prompt + output) tokens/s. Prompt tokens are the server's count (its usage) where it
  gives one, as vLLM's benchmark counts them; output tokens likewise.
- Goodput: requests/s (and output tokens/s) of requests that met every SLO given: TTFT <=
  `ttft_ms`, TPOT <= `tpot_ms`, and the request's own p99 inter-token gap <= `itl_ms`.
Percentiles interpolate linearly between order statistics (numpy's default); times are in ms.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from kvmesh.loadgen.backends import RequestRecord

PERCENTILES = (50, 90, 99)
LATENCIES = ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms")


@dataclass(frozen=True)
class Slo:
    ttft_ms: float | None = None
    tpot_ms: float | None = None
    itl_ms: float | None = None

    def met_by(self, record: RequestRecord) -> bool:
        if not record.ok:
            return False
        checks = (
            (self.ttft_ms, record.ttft * 1000),
            (self.tpot_ms, (record.tpot or 0.0) * 1000),
            (self.itl_ms, percentile([g * 1000 for g in record.itls], 99) if record.itls else 0.0),
        )
        return all(limit is None or value <= limit for limit, value in checks)

    def as_dict(self) -> dict[str, float]:
        return {k: v for k, v in asdict(self).items() if v is not None}


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) of non-empty `values`, linear interpolation."""
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def distribution(values_s: Sequence[float]) -> dict[str, float] | None:
    """Mean and percentiles in milliseconds of `values_s` (seconds); None when empty."""
    if not values_s:
        return None
    ms = [v * 1000 for v in values_s]
    out = {"mean": sum(ms) / len(ms)}
    out.update({f"p{q}": percentile(ms, q) for q in PERCENTILES})
    return {k: round(v, 3) for k, v in out.items()}


def latencies(records: Sequence[RequestRecord]) -> dict[str, list[float]]:
    """Latency samples (seconds) of the successful records."""
    ok = [r for r in records if r.ok]
    return {
        "ttft_ms": [r.ttft for r in ok],
        "tpot_ms": [t for r in ok if (t := r.tpot) is not None],
        "itl_ms": [g for r in ok for g in r.itls],
        "e2e_ms": [r.e2e for r in ok],
    }


def summarize(records: Sequence[RequestRecord], duration: float, slo: Slo) -> dict[str, Any]:
    """The metrics of one run (see the module docstring), JSON-ready."""
    ok = [r for r in records if r.ok]
    good = [r for r in ok if slo.met_by(r)]
    seconds = max(duration, 1e-9)
    output_tokens = sum(r.output_tokens for r in ok)
    input_tokens = sum(r.prompt_len for r in ok)
    summary: dict[str, Any] = {
        "requests": len(records),
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "errors": sorted({r.error for r in records if r.error})[:5],
        "duration_s": round(duration, 3),
        "input_tokens": input_tokens,
        "output_tokens": output_tokens,
        "expected_output_tokens": sum(r.expected_output for r in ok),
        "request_throughput": round(len(ok) / seconds, 4),
        "output_throughput": round(output_tokens / seconds, 3),
        "total_token_throughput": round((input_tokens + output_tokens) / seconds, 3),
        "good_requests": len(good),
        "goodput": round(len(good) / seconds, 4),
        "goodput_output_throughput": round(sum(r.output_tokens for r in good) / seconds, 3),
        "slo": slo.as_dict(),
    }
    summary.update({name: distribution(v) for name, v in latencies(records).items()})
    return summary


def by_group(records: Sequence[RequestRecord], duration: float, slo: Slo) -> dict[str, Any]:
    """`summarize` of each request group (W4: steady, long), when there is more than one."""
    groups = sorted({r.group for r in records})
    if len(groups) < 2:
        return {}
    return {g: summarize([r for r in records if r.group == g], duration, slo) for g in groups}
