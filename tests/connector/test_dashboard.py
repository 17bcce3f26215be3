"""The Grafana dashboard ``deploy/grafana/lazy-offload.json`` charts what the
connector exports, all of it, per engine.

What the connector exports is not a hand list: :func:`exported_metrics` builds
:class:`connector.shell.metrics.LazyOffloadPromMetrics` with vLLM's own Prometheus
metric classes (``KVConnectorProm``'s) against a fresh ``CollectorRegistry``
and the label names vLLM's ``PrometheusStatLogger`` passes (``model_name``,
``engine``), once for each primary selection reason, and reads back every
family, sample name, label name and label value the registry holds.

Rules checked on every ``expr`` of every panel (rows' nested panels included):

* every ``vllm:…`` identifier is a sample name the connector exports (no
  ``_created``); every exported family is charted at least once, and every
  value of a family's extra label (a drop ``cause``, a ``reason``) appears in
  an equality matcher of that family somewhere;
* per engine, both ways: every selector filters
  ``model_name=~"$model_name"`` and ``engine=~"$engine"``; every aggregation
  keeps ``engine`` (``by (…, engine, …)`` or ``without (…)`` not naming it);
  every ``legendFormat`` carries ``{{engine}}``, and names only labels the
  query's result has (the metrics' common labels, or ``job``/``instance``,
  which Prometheus adds at scrape time);
* every other matcher names a label the metric carries, and an ``=``/``!=``
  matcher a value it exports.

And the dashboard has the template variables ``DS_PROMETHEUS`` (the
datasource every panel and target uses), ``model_name`` and a multi-select
``engine``, their queries naming exported metrics too.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

import pytest

from testkit.env import require_stack

require_stack()

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorProm  # noqa: E402

from connector.shell import metrics  # noqa: E402
from offload_fsm.vocabulary.counters import SELECTED_BY  # noqa: E402
from offload_fsm.vocabulary.decisions import SelectReason  # noqa: E402

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "lazy-offload.json"
DATASOURCE_UID = "${DS_PROMETHEUS}"
# vllm/v1/metrics/loggers.py, PrometheusStatLogger.__init__: ``labelnames``.
VLLM_LABELNAMES = ("model_name", "engine")
SCRAPE_LABELS = frozenset({"job", "instance"})  # added by Prometheus to every scraped series
REQUIRED_FILTERS = (("model_name", "=~", "$model_name"), ("engine", "=~", "$engine"))

METRIC = re.compile(r"vllm:[a-zA-Z0-9_:]+")
SELECTOR = re.compile(r"(vllm:[a-zA-Z0-9_:]+)\s*(\{[^}]*\})?")
MATCHER = re.compile(r'([a-zA-Z_]\w*)\s*(=~|!~|!=|=)\s*"((?:[^"\\]|\\.)*)"')
AGGREGATION = re.compile(
    r"\b(sum|avg|min|max|count|group|stddev|stdvar|topk|bottomk|quantile|count_values)"
    r"\s*(?:(by|without)\s*\(([^)]*)\))?\s*\(")
LEGEND_LABEL = re.compile(r"\{\{\s*([a-zA-Z_]\w*)\s*\}\}")


@dataclass
class Exported:
    """One metric family as the connector exports it."""

    kind: str
    series: set[str] = field(default_factory=set)  # sample names a query may use
    labels: set[str] = field(default_factory=set)  # every label name, le included
    values: dict[str, set[str]] = field(default_factory=dict)  # extra label -> values


class _Config:
    kv_transfer_config = None


def _bound(cls: type, registry: CollectorRegistry) -> type:
    """vLLM's metric class, registering in ``registry`` instead of the global one."""
    class Bound(cls):  # type: ignore[misc]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, registry=registry, **kwargs)
    return Bound


@cache
def exported_metrics() -> dict[str, Exported]:
    """Family name -> what the connector's Prometheus class registers, read back
    from a fresh registry (two engines, one per primary selection reason)."""
    families: dict[str, Exported] = {}
    primaries = [reason for reason in SelectReason if reason not in SELECTED_BY]
    for primary in primaries:
        registry = CollectorRegistry()
        types: dict[type, type] = {
            Gauge: _bound(KVConnectorProm._gauge_cls, registry),
            Counter: _bound(KVConnectorProm._counter_cls, registry),
            Histogram: _bound(KVConnectorProm._histogram_cls, registry),
        }
        metrics.LazyOffloadPromMetrics(_Config(), types, list(VLLM_LABELNAMES),
                                       {0: ["m", "0"], 1: ["m", "1"]}, primary_reason=primary)
        for family in registry.collect():
            entry = families.setdefault(family.name, Exported(family.type))
            for sample in family.samples:
                if sample.name.endswith("_created"):
                    continue
                entry.series.add(sample.name)
                entry.labels.update(sample.labels)
                for label, value in sample.labels.items():
                    if label not in VLLM_LABELNAMES and label != "le":
                        entry.values.setdefault(label, set()).add(value)
    return families


def _by_series() -> dict[str, tuple[str, Exported]]:
    return {name: (family, entry) for family, entry in exported_metrics().items()
            for name in entry.series}


def _panels(panels: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for panel in panels:
        out.append(panel)
        out.extend(_panels(panel.get("panels", [])))
    return out


def _load() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text(encoding="utf-8"))  # type: ignore[no-any-return]


def _targets(dashboard: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """(panel title, target) for every query target of every panel."""
    return [(panel.get("title", "?"), target) for panel in _panels(dashboard["panels"])
            for target in panel.get("targets", [])]


def _variables(dashboard: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {v["name"]: v for v in dashboard["templating"]["list"]}


def _variable_query(variable: dict[str, Any]) -> str:
    query = variable.get("query", "")
    return query.get("query", "") if isinstance(query, dict) else str(query)


def dashboard_problems(dashboard: dict[str, Any]) -> list[str]:
    """Every rule of the module docstring that ``dashboard`` breaks, one line each."""
    by_series = _by_series()
    problems: list[str] = []
    used: set[str] = set()
    matched: dict[str, dict[str, set[str]]] = {}  # family -> label -> values matched with =
    for title, target in _targets(dashboard):
        expr = target.get("expr", "")
        where = f"{title!r} {target.get('refId', '?')}"
        if not expr.strip():
            problems.append(f"{where}: no expr")
            continue
        names = METRIC.findall(expr)
        if not names:
            problems.append(f"{where}: names no vllm: metric")
        used.update(names)
        result_labels: set[str] | None = None
        for name, braces in SELECTOR.findall(expr):
            if name not in by_series:
                problems.append(f"{where}: {name} is not exported by the connector")
                continue
            family, entry = by_series[name]
            labels = entry.labels - {"le"} if not name.endswith("_bucket") else entry.labels
            result_labels = labels if result_labels is None else result_labels & labels
            matchers = MATCHER.findall(braces)
            for required in REQUIRED_FILTERS:
                if required not in matchers:
                    problems.append(f'{where}: {name} lacks {required[0]}=~"{required[2]}"')
            for label, op, value in matchers:
                if label not in entry.labels:
                    problems.append(f"{where}: {name} has no label {label!r}")
                elif op in ("=", "!=") and value not in entry.values.get(label, set()):
                    problems.append(f"{where}: {name} never exports {label}={value!r}")
                elif op == "=":
                    matched.setdefault(family, {}).setdefault(label, set()).add(value)
        kept = set(result_labels or set()) | SCRAPE_LABELS
        for aggregation, clause, grouping in AGGREGATION.findall(expr):
            grouped = {g.strip() for g in grouping.split(",") if g.strip()}
            if clause == "by":
                kept &= grouped
            elif clause == "without":
                kept -= grouped
            if "engine" not in kept or not clause:
                how = f"{clause} ({grouping})" if clause else "with no by/without"
                problems.append(f"{where}: {aggregation} {how} drops engine")
        legend = target.get("legendFormat", "")
        shown = set(LEGEND_LABEL.findall(legend))
        if "engine" not in shown:
            problems.append(f"{where}: legend {legend!r} lacks {{{{engine}}}}")
        for label in sorted(shown - kept):
            problems.append(f"{where}: legend label {label!r} is not on the query's result")
    for variable in dashboard.get("templating", {}).get("list", []):
        for name in METRIC.findall(_variable_query(variable)):
            used.add(name)
            if name not in by_series:
                problems.append(f"variable {variable['name']}: {name} is not exported")
    for family, entry in sorted(exported_metrics().items()):
        if not entry.series & used:
            problems.append(f"{family} ({entry.kind}) is in no panel")
        for label, values in sorted(entry.values.items()):
            missing = values - matched.get(family, {}).get(label, set())
            if missing:
                problems.append(f"{family}: {label} {sorted(missing)} charted nowhere")
    return problems


def test_the_exported_set_comes_from_the_connector() -> None:
    families = exported_metrics()
    lazy = {name for name in families if name.startswith(metrics.METRIC_PREFIX)}
    assert lazy == ({family.name for family in metrics.COUNTER_FAMILIES}
                    | {metrics.METRIC_PREFIX + name for name in metrics.GAUGES})
    for name in lazy:
        entry = families[name]
        suffix = "_total" if entry.kind == "counter" else ""
        assert entry.series == {name + suffix}, name
        assert set(VLLM_LABELNAMES) <= entry.labels, name
    assert families[metrics.METRIC_PREFIX + "dropped_ops"].values["cause"] >= {
        "evicted", "duplicate"}
    assert {"window", "fifo"} <= families[metrics.METRIC_PREFIX + "selected_ops"].values[
        "reason"]
    assert "vllm:lmcache_mp_lookup_duration_seconds" in families  # LMCache's, kept


def test_every_query_names_an_exported_metric_per_engine_and_all_are_charted() -> None:
    problems = dashboard_problems(_load())
    assert not problems, "\n".join(problems)


def test_a_misspelled_or_engine_blind_query_is_caught() -> None:
    dashboard = _load()
    good = 'model_name=~"$model_name", engine=~"$engine"'
    dashboard["panels"].append({"type": "timeseries", "title": "bad", "targets": [
        {"refId": "A", "expr": f"vllm:lazy_offload_admited_ops_total{{{good}}}",
         "legendFormat": "{{engine}}"},
        {"refId": "B", "expr": f"sum(vllm:lazy_offload_buffered_ops{{{good}}})",
         "legendFormat": "{{engine}}"},
        {"refId": "C", "expr": 'vllm:lazy_offload_pinned_blocks{model_name=~"$model_name"}',
         "legendFormat": "{{instance}}"},
        {"refId": "D", "expr": f'vllm:lazy_offload_dropped_ops_total{{{good}, cause="evict"}}',
         "legendFormat": "{{engine}} {{cause}}"},
    ]})
    problems = "\n".join(dashboard_problems(dashboard))
    assert "admited_ops_total is not exported" in problems
    assert "sum with no by/without drops engine" in problems
    assert "pinned_blocks lacks engine" in problems
    assert "legend '{{instance}}' lacks" in problems
    assert "never exports cause='evict'" in problems


def test_template_variables() -> None:
    dashboard = _load()
    variables = _variables(dashboard)
    assert {"DS_PROMETHEUS", "model_name", "engine"} <= set(variables)
    assert variables["DS_PROMETHEUS"]["type"] == "datasource"
    assert variables["DS_PROMETHEUS"]["query"] == "prometheus"
    model, engine = variables["model_name"], variables["engine"]
    assert model["type"] == engine["type"] == "query"
    assert re.fullmatch(r"label_values\(vllm:lazy_offload_admitted_ops_total(\{[^}]*\})?, "
                        r"model_name\)", _variable_query(model))
    assert re.fullmatch(r"label_values\(vllm:lazy_offload_admitted_ops_total(\{[^}]*\})?, "
                        r"engine\)", _variable_query(engine))
    assert engine["multi"] is True and engine["includeAll"] is True
    for variable in (model, engine):
        assert variable["datasource"]["uid"] == DATASOURCE_UID
    for panel in _panels(dashboard["panels"]):
        if panel["type"] == "row":
            continue
        assert panel["datasource"] == {"type": "prometheus", "uid": DATASOURCE_UID}, panel["title"]
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert target.get("datasource", panel["datasource"])["uid"] == DATASOURCE_UID


def test_panel_ids_are_unique_and_every_panel_has_a_unit() -> None:
    panels = _panels(_load()["panels"])
    ids = [panel["id"] for panel in panels]
    assert len(ids) == len(set(ids))
    for panel in panels:
        if panel["type"] != "row":
            assert panel["fieldConfig"]["defaults"].get("unit"), panel["title"]


@pytest.mark.parametrize("family", sorted(n for n in exported_metrics()
                                          if n.startswith(metrics.METRIC_PREFIX)))
def test_each_lazy_offload_metric_is_in_a_panel(family: str) -> None:
    """One case per exported family, so a new metric that is not charted names itself."""
    series = exported_metrics()[family].series
    used = {name for _, target in _targets(_load()) for name in METRIC.findall(target["expr"])}
    assert series & used, f"{family} is in no panel of {DASHBOARD.name}"
