"""The chunked-prefill tuner: which step budget, chunk cap and scheduling policy serve a
workload best under inter-token and first-token latency SLOs.

A setting is the engine's `max_num_batched_tokens` (tokens per step), `long_prefill_token_threshold`
(most prompt tokens of one sequence per step; None: the budget) and `scheduling_policy`. Each is
measured on its own freshly started system with the same requests and arrivals. A setting meets
the SLOs when every request completed, the p99 of all inter-token gaps is at most `itl_p99_ms`
and (when given) the p99 TTFT at most `ttft_p99_ms`. Among those, the recommendation is the one
with the highest goodput (output tokens/s of the requests that met the SLOs themselves, see
`kvmesh.loadgen.metrics`), then the highest throughput.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

POLICY_SHORT = {"decode-first": "df", "prefill-first": "pf"}


@dataclass(frozen=True)
class Setting:
    budget: int
    chunk: int | None
    policy: str

    @property
    def name(self) -> str:
        chunk = "-" if self.chunk is None else str(self.chunk)
        return f"{self.budget}/{chunk}/{POLICY_SHORT.get(self.policy, self.policy)}"

    def flags(self) -> list[str]:
        """The `kvmesh up` / `kvmesh serve` flags of this setting."""
        words = ["--max-num-batched-tokens", str(self.budget)]
        if self.chunk is not None:
            words += ["--long-prefill-token-threshold", str(self.chunk)]
        return [*words, "--scheduling-policy", self.policy]


def grid(
    budgets: Sequence[int], chunks: Sequence[int | None], policies: Sequence[str]
) -> list[Setting]:
    """Every combination, skipping chunk caps at or above the budget (the same as none)."""
    from kvmesh.engine.scheduler import SCHEDULING_POLICIES

    for policy in policies:
        if policy not in SCHEDULING_POLICIES:
            raise ValueError(
                f"--policies: {policy!r} is not one of {', '.join(SCHEDULING_POLICIES)}"
            )
    for value in (*budgets, *(c for c in chunks if c is not None)):
        if value <= 0:
            raise ValueError(f"--budgets and --chunks must be positive, got {value}")
    return [Setting(b, c, p) for p, b, c in itertools.product(policies, budgets, chunks)
            if c is None or c < b]  # fmt: skip


def parse_chunks(text: str) -> list[int | None]:
    """`none,256,512` -> [None, 256, 512]."""
    return [None if w.strip().lower() in ("none", "-", "") else int(w) for w in text.split(",")]


def row(name: str, setting: Setting | None, summary: dict[str, Any], itl_p99_ms: float,
        ttft_p99_ms: float | None) -> dict[str, Any]:  # fmt: skip
    """One table row: the setting, its measurements, whether it meets the SLOs."""
    itl, ttft = summary["itl_ms"], summary["ttft_ms"]
    measured = {
        "itl_p50_ms": itl["p50"] if itl else None,
        "itl_p99_ms": itl["p99"] if itl else None,
        "ttft_p99_ms": ttft["p99"] if ttft else None,
        "output_throughput": summary["output_throughput"],
        "goodput_output_throughput": summary["goodput_output_throughput"],
        "completed": summary["completed"],
        "failed": summary["failed"],
    }
    meets = (summary["failed"] == 0 and measured["itl_p99_ms"] is not None
             and measured["itl_p99_ms"] <= itl_p99_ms
             and (ttft_p99_ms is None or measured["ttft_p99_ms"] <= ttft_p99_ms))  # fmt: skip
    knobs: dict[str, Any] = {"budget": None, "chunk": None, "policy": None, "flags": None}
    if setting is not None:
        knobs = {"budget": setting.budget, "chunk": setting.chunk, "policy": setting.policy,
                 "flags": setting.flags()}  # fmt: skip
    return {"name": name, **knobs, **measured, "meets_slo": bool(meets), "recommended": False}


def recommend(rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The row meeting the SLOs with the best goodput (then throughput), marked; None if none."""
    feasible = [r for r in rows if r["meets_slo"]]
    if not feasible:
        return None
    best = max(feasible, key=lambda r: (r["goodput_output_throughput"], r["output_throughput"]))
    best["recommended"] = True
    return best
