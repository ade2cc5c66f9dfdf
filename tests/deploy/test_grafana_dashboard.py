"""deploy/grafana/kvmesh.json: every PromQL expression names only metrics some kvmesh process
registers, and the panels an operator needs are there."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from control_plane.metrics import ControlMetrics
from kvmesh.telemetry.metrics import ROLES, WorkerMetrics

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "kvmesh.json"
SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_count", "_sum"), "gauge": ("",)}
KEYWORDS = {"and", "or", "unless", "bool", "offset", "inf", "nan"}
IDENTIFIER = re.compile(r"(?<![\w.$])[a-zA-Z_:][a-zA-Z0-9_:]*")
GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")


def sample_names(registry: CollectorRegistry) -> set[str]:
    """The exposition names (`_total`, `_bucket`, ...) of every family in `registry`."""
    return {
        family.name + suffix for family in registry.collect() for suffix in SUFFIXES[family.type]
    }


def registered() -> set[str]:
    """Sample names of every role's worker registry (engine bound) and the control plane's."""
    load = SimpleNamespace(total_blocks=1, free_blocks=1, running=0, waiting=0,
                           prefix_query_tokens=0, prefix_hit_tokens=0, preemptions=0)  # fmt: skip
    names: set[str] = set()
    for role in ROLES:
        worker = WorkerMetrics(role)
        worker.bind_engine(lambda: load, "model")
        names |= sample_names(worker.registry)
    control = ControlMetrics()
    control.watch_ledger(lambda: {}, ("ROUTED",))
    return names | sample_names(control.registry)


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression reads (functions, keywords, labels left out)."""
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    expr = re.sub(r"\{[^}]*\}|\[[^\]]*\]", " ", expr)
    expr = GROUPING.sub(" ", expr)
    names = set()
    for match in IDENTIFIER.finditer(expr):
        if expr[match.end() :].lstrip().startswith("(") or match.group() in KEYWORDS:
            continue
        names.add(match.group())
    return names


def expressions(dashboard: dict[str, Any]) -> Iterator[tuple[str, str]]:
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            yield panel["title"], target["expr"]
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            query = variable["query"]
            text = query["query"] if isinstance(query, dict) else query
            label_values = re.fullmatch(r"label_values\((.+),\s*\w+\)", text)
            yield variable["name"], label_values.group(1) if label_values else text


@pytest.fixture(scope="module")
def dashboard() -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return loaded


def test_every_expression_names_registered_metrics(dashboard: dict[str, Any]) -> None:
    known = registered()
    found = 0
    for where, expr in expressions(dashboard):
        names = metric_names(expr)
        assert names, f"{where}: no metric in {expr!r}"
        assert names <= known, f"{where}: {sorted(names - known)} not registered"
        found += len(names)
    assert found >= 30


def test_the_parser_finds_metrics_and_skips_the_rest() -> None:
    expr = (
        'histogram_quantile(0.99, sum by (le, phase) (rate(kvmesh:a_bucket{x="y(z)"}'
        "[$__rate_interval]))) / clamp_min(sum(rate(b_total[5m])), 1e-9) and on(pod) c"
    )
    assert metric_names(expr) == {"kvmesh:a_bucket", "b_total", "c"}


def test_the_operator_panels_are_there(dashboard: dict[str, Any]) -> None:
    panels = {p["title"]: p for p in dashboard["panels"] if p["type"] != "row"}
    for title in ("Time to first token", "Inter-token latency"):
        legends = {t["legendFormat"] for t in panels[title]["targets"]}
        assert legends == {"p50", "p90", "p99"}, title
    wanted = {
        "Throughput": "kvmesh:generation_tokens_total",
        "KV cache usage": "kvmesh:kv_cache_usage_perc",
        "Prefix cache hit rate": "kvmesh:prefix_cache_hits_total",
        "KV transfer bandwidth": "kvmesh_kv_transfer_bytes_total",
        "Errors by code": "kvmesh_control_requests_total",
    }
    for title, metric in wanted.items():
        assert any(metric in t["expr"] for t in panels[title]["targets"]), title
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
