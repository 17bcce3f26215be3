"""The Prometheus rules ``deploy/prometheus/lazy-offload-rules.yml`` (the
README's alerts) watch what the connector exports, per engine.

Against the metrics :func:`tests.connector.test_dashboard.exported_metrics`
reads back from the connector's own Prometheus class: every ``vllm:…`` name
in every ``expr`` is an exported sample name; every matcher names a label the
metric carries, and an ``=``/``!=`` matcher a value it exports; every
aggregation keeps ``engine`` (``by (…, engine, …)``). Every rule has an
alert name, a ``for``, a severity, and a summary and description, and the
README names every alert."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from testkit.env import require_stack

require_stack()

import yaml  # noqa: E402

from tests.connector.test_dashboard import (  # noqa: E402
    AGGREGATION,
    MATCHER,
    METRIC,
    SELECTOR,
    exported_metrics,
)

REPO = Path(__file__).resolve().parents[2]
RULES = REPO / "deploy" / "prometheus" / "lazy-offload-rules.yml"


def _rules() -> list[dict[str, Any]]:
    loaded = yaml.safe_load(RULES.read_text(encoding="utf-8"))
    return [rule for group in loaded["groups"] for rule in group["rules"]]


def rule_problems(rules: list[dict[str, Any]]) -> list[str]:
    """Every rule of the module docstring that ``rules`` break, one line each."""
    by_series = {name: entry for entry in exported_metrics().values() for name in entry.series}
    problems = []
    for rule in rules:
        where = rule.get("alert", "?")
        expr = str(rule.get("expr", ""))
        if not METRIC.findall(expr):
            problems.append(f"{where}: names no vllm: metric")
        for name, braces in SELECTOR.findall(expr):
            entry = by_series.get(name)
            if entry is None:
                problems.append(f"{where}: {name} is not exported by the connector")
                continue
            for label, op, value in MATCHER.findall(braces):
                if label not in entry.labels:
                    problems.append(f"{where}: {name} has no label {label!r}")
                elif op in ("=", "!=") and value not in entry.values.get(label, set()):
                    problems.append(f"{where}: {name} never exports {label}={value!r}")
        for aggregation, clause, grouping in AGGREGATION.findall(expr):
            if clause != "by" or "engine" not in {g.strip() for g in grouping.split(",")}:
                problems.append(f"{where}: {aggregation} {clause} ({grouping}) drops engine")
        for key in ("alert", "expr", "for"):
            if key not in rule:
                problems.append(f"{where}: no {key}")
        if rule.get("labels", {}).get("severity") not in ("warning", "critical"):
            problems.append(f"{where}: severity is not warning or critical")
        for key in ("summary", "description"):
            if not rule.get("annotations", {}).get(key):
                problems.append(f"{where}: no {key}")
    return problems


def test_every_rule_watches_exported_metrics_per_engine() -> None:
    rules = _rules()
    assert len(rules) >= 5
    assert rule_problems(rules) == []
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    assert [r["alert"] for r in rules if r["alert"] not in readme] == []


def test_the_check_catches_what_it_looks_for() -> None:
    bad = [
        {"alert": "A", "expr": "vllm:lazy_offload_no_such_metric > 0", "for": "1m",
         "labels": {"severity": "warning"}, "annotations": {"summary": "s", "description": "d"}},
        {"alert": "B", "expr": 'sum(rate(vllm:lazy_offload_dropped_ops_total{cause="gone"}[5m]))',
         "labels": {"severity": "page"}, "annotations": {"summary": "s"}},
    ]
    problems = rule_problems(bad)
    assert "A: vllm:lazy_offload_no_such_metric is not exported by the connector" in problems
    assert "B: vllm:lazy_offload_dropped_ops_total never exports cause='gone'" in problems
    assert "B: sum  () drops engine" in problems
    assert "B: no for" in problems and "B: no description" in problems
    assert "B: severity is not warning or critical" in problems
