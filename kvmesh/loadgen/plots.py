"""PNG plots of serving-benchmark results (matplotlib, Agg backend, small files).

A result is what `kvmesh bench serve --json` prints: `{"label", "runs": [{"rate", "summary",
"samples"}]}`, `samples` holding each latency's values in ms.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from kvmesh.loadgen.metrics import LATENCIES

TITLES = {"ttft_ms": "TTFT", "tpot_ms": "TPOT", "itl_ms": "ITL", "e2e_ms": "end-to-end"}
DPI = 72
FLOOR_MS = 1e-3  # latencies on a log axis start here (a 0 ms gap: two events in one read)


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def rate_label(rate: Any) -> str:
    return "inf" if rate is None or (isinstance(rate, float) and math.isinf(rate)) else f"{rate:g}"


def latency_cdfs(results: list[dict[str, Any]], path: Path) -> Path:
    """One panel per latency, a CDF line per (result, rate), log-scaled milliseconds."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(LATENCIES), figsize=(12, 3), dpi=DPI)
    for ax, name in zip(axes, LATENCIES, strict=True):
        for result in results:
            for run in result["runs"]:
                values = sorted(max(v, FLOOR_MS) for v in run["samples"].get(name) or [])
                if values:
                    ys = [(i + 1) / len(values) for i in range(len(values))]
                    ax.step(values, ys, where="post",
                            label=f"{result['label']} @ {rate_label(run['rate'])}")  # fmt: skip
        ax.set_title(TITLES[name], fontsize=9)
        ax.set_xscale("log")
        ax.set_xlabel("ms (log)", fontsize=8)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("fraction of samples", fontsize=8)
    axes[-1].legend(fontsize=6, loc="lower right")
    return _save(fig, plt, path)


def rate_sweep(results: list[dict[str, Any]], path: Path) -> Path:
    """Output throughput, p99 TTFT and p99 ITL (log scale) and goodput against request rate,
    a line per result."""
    plt = _pyplot()
    panels = (("output_throughput", None, "output tokens/s"), ("ttft_ms", "p99", "p99 TTFT (ms)"),
              ("itl_ms", "p99", "p99 ITL (ms)"), ("goodput", None, "goodput (req/s)"))  # fmt: skip
    fig, axes = plt.subplots(1, len(panels), figsize=(12, 3), dpi=DPI)
    for ax, (key, stat, title) in zip(axes, panels, strict=True):
        for result in results:
            runs = [r for r in result["runs"] if isinstance(r["rate"], int | float)]
            xs = [r["rate"] for r in runs]
            ys = [_value(r["summary"], key, stat) for r in runs]
            ax.plot(xs, ys, marker="o", markersize=3, label=result["label"])
        if stat is not None:
            ax.set_yscale("log")
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("request rate (req/s)", fontsize=8)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=6)
    return _save(fig, plt, path)


def tuner_scatter(rows: list[dict[str, Any]], slo_itl_ms: float, path: Path) -> Path:
    """Throughput against p99 ITL of every setting; the SLO as a line, the pick circled."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=DPI)
    for row in rows:
        color = "tab:green" if row["meets_slo"] else "tab:red"
        ax.scatter(row["itl_p99_ms"], row["output_throughput"], color=color, s=18)
        ax.annotate(row["name"], (row["itl_p99_ms"], row["output_throughput"]), fontsize=6,
                    xytext=(3, 3), textcoords="offset points")  # fmt: skip
        if row.get("recommended"):
            ax.scatter(row["itl_p99_ms"], row["output_throughput"], s=120, facecolors="none",
                       edgecolors="black")  # fmt: skip
    ax.axvline(slo_itl_ms, color="gray", linestyle="--", linewidth=1, label="ITL p99 SLO")
    ax.set_xlabel("p99 inter-token latency (ms)", fontsize=8)
    ax.set_ylabel("output tokens/s", fontsize=8)
    ax.tick_params(labelsize=7)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    return _save(fig, plt, path)


def _value(summary: dict[str, Any], key: str, stat: str | None) -> float | None:
    value = summary.get(key)
    if stat is None:
        return float(value) if value is not None else None
    return None if value is None else float(value[stat])


def _save(fig: Any, plt: Any, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return path
