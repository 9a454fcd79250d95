"""deploy/monitoring: the Grafana dashboard and the Prometheus rules parse, and every metric they
read is one serving/metrics.py exports (or a recording rule defined next to them)."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest

from tests.deploy.support import (
    DOCS,
    MONITORING_DIR,
    ROOT,
    exported_metric_names,
    has_module,
    iter_dashboard_panels,
    load_yaml,
    metric_names,
    substitute_grafana_variables,
)

EXPORTED = exported_metric_names()
DASHBOARD: dict[str, Any] = json.loads((MONITORING_DIR / "grafana-dashboard.json").read_text())
RULES: dict[str, Any] = load_yaml(MONITORING_DIR / "alerts.yaml")
RECORDED = {rule["record"] for group in RULES["groups"] for rule in group["rules"] if "record" in rule}
ALERTS = [rule for group in RULES["groups"] for rule in group["rules"] if "alert" in rule]
METRICS_SOURCE = (ROOT / "serving" / "metrics.py").read_text()


def _dashboard_queries() -> list[tuple[str, str]]:
    queries = []
    for panel in iter_dashboard_panels(DASHBOARD):
        for target in panel.get("targets", []):
            queries.append((panel["title"], target["expr"]))
    for variable in DASHBOARD["templating"]["list"]:
        if variable["type"] == "query":
            inner = re.fullmatch(r"label_values\((\w+),\s*\w+\)", variable["definition"])
            assert inner, variable["definition"]
            queries.append((f"variable {variable['name']}", inner.group(1)))
    return queries


def _family(sample_name: str) -> str:
    return re.sub(r"_(bucket|sum|count|total|created)$", "", sample_name)


def test_the_promql_parser_refuses_a_broken_expression() -> None:
    """The checks below parse PromQL with promql-parser (a dev dependency) when it is installed:
    it must be, and it must refuse what Prometheus would refuse, or they would pass on anything."""
    if not has_module("promql_parser"):
        pytest.skip("promql-parser is not installed: PromQL was checked with a regex, not parsed")
    import promql_parser

    with pytest.raises(ValueError):
        promql_parser.parse("sum(rate(tandem_serving_items_total[5m])")
    assert metric_names("rate(tandem_serving_items_total[5m]) / on() tandem_serving_p99_target_seconds") == {
        "tandem_serving_items_total",
        "tandem_serving_p99_target_seconds",
    }


def test_the_exported_names_include_every_metric_serving_metrics_defines() -> None:
    # Guards the helper the checks below compare against: every metric serving/metrics.py names is
    # in the registry it inspects, with its samples (a labelled counter only has one once a child
    # is touched), so a metric left out of the registry, or never sampled, fails here.
    defined = set(re.findall(r'"(tandem_serving_[a-z0-9_]+)"', METRICS_SOURCE))
    assert len(defined) >= 10, defined
    assert defined <= EXPORTED, sorted(defined - EXPORTED)


def test_dashboard_is_a_grafana_dashboard() -> None:
    assert DASHBOARD["uid"] and DASHBOARD["title"]
    assert isinstance(DASHBOARD["schemaVersion"], int)
    panels = list(iter_dashboard_panels(DASHBOARD))
    ids = [panel["id"] for panel in panels]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    for panel in panels:
        assert {"h", "w", "x", "y"} <= set(panel["gridPos"]), panel["title"]
        assert panel["gridPos"]["x"] + panel["gridPos"]["w"] <= 24, panel["title"]
        if panel["type"] != "row":
            assert panel["targets"], panel["title"]
            assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
    assert any(v["type"] == "datasource" and v["query"] == "prometheus" for v in DASHBOARD["templating"]["list"])


@pytest.mark.parametrize(("title", "expr"), _dashboard_queries())
def test_dashboard_query_reads_only_exported_metrics(title: str, expr: str) -> None:
    names = metric_names(substitute_grafana_variables(expr))
    unknown = names - EXPORTED
    assert not unknown, f"{title!r} reads metrics the service does not export: {sorted(unknown)}"


def test_dashboard_covers_what_operators_need() -> None:
    read = set()
    for _, expr in _dashboard_queries():
        read |= {_family(name) for name in metric_names(substitute_grafana_variables(expr))}
    required = {
        "tandem_serving_request_latency_seconds",  # quantiles, availability, budget burn
        "tandem_serving_p99_target_seconds",  # the declared target, from the service itself
        "tandem_serving_queue_depth",
        "tandem_serving_queue_wait_seconds",
        "tandem_serving_shed",
        "tandem_serving_batch_size",
        "tandem_serving_item_errors",
        "tandem_serving_request_cpu_seconds",
        "tandem_serving_outbox_depth",
        "tandem_serving_db_breaker_state",
    }
    assert required <= read, sorted(required - read)
    exprs = " ".join(expr for _, expr in _dashboard_queries())
    assert "histogram_quantile(0.99" in exprs
    assert "by (reason)" in exprs


def test_rules_file_structure() -> None:
    assert set(RULES) == {"groups"}
    names = [group["name"] for group in RULES["groups"]]
    assert len(names) == len(set(names))
    for group in RULES["groups"]:
        for rule in group["rules"]:
            assert ("alert" in rule) != ("record" in rule), rule
            assert isinstance(rule["expr"], str) and rule["expr"].strip()
            assert set(rule) <= {"alert", "record", "expr", "for", "keep_firing_for", "labels", "annotations"}
            if "for" in rule:
                assert re.fullmatch(r"\d+[smhd]", rule["for"]), rule["for"]
    for alert in ALERTS:
        assert alert["labels"]["severity"] in {"page", "ticket", "warning"}, alert["alert"]
        assert alert["annotations"]["summary"], alert["alert"]
    alert_names = [alert["alert"] for alert in ALERTS]
    assert len(alert_names) == len(set(alert_names))


@pytest.mark.parametrize(
    "rule", [r for g in RULES["groups"] for r in g["rules"]], ids=lambda r: r.get("alert") or r["record"]
)
def test_rule_expression_reads_only_exported_or_recorded_metrics(rule: dict[str, Any]) -> None:
    names = metric_names(rule["expr"])
    assert names, "an expression that reads no metric"
    unknown = names - EXPORTED - RECORDED
    assert not unknown, f"{rule.get('alert') or rule['record']} reads unknown metrics: {sorted(unknown)}"


def test_recording_rules_are_all_used_and_follow_the_naming_convention() -> None:
    used: set[str] = set()
    for alert in ALERTS:
        used |= metric_names(alert["expr"])
    for name in RECORDED:
        assert re.fullmatch(r"[a-z_]+:[a-z_]+:[a-z_0-9]+", name), name
    assert used & RECORDED == RECORDED, f"unused recording rules: {sorted(RECORDED - used)}"


def test_required_alerts_exist() -> None:
    exprs = {alert["alert"]: alert["expr"] for alert in ALERTS}
    # Multi-window, multi-burn-rate: each budget alert pairs a long and a short window.
    burn = [name for name in exprs if "BudgetBurn" in name]
    assert len(burn) >= 4
    for name in burn:
        windows = set(re.findall(r"ratio_rate(\d+[mhd])", exprs[name]))
        assert len(windows) >= 2, name
    assert any("tandem_serving_p99_target_seconds" in expr for expr in exprs.values()), "p99 above target"
    assert any("tandem_serving_outbox_depth" in expr and "deriv(" in expr for expr in exprs.values()), "outbox"
    assert any("tandem_serving_shed_total" in expr for expr in exprs.values()), "shedding sustained"


def test_every_runbook_link_points_at_a_runbook_section() -> None:
    runbook = (DOCS / "runbook.md").read_text()
    anchors = {_github_anchor(line.lstrip("#").strip()) for line in runbook.splitlines() if line.startswith("#")}
    for alert in ALERTS:
        url = alert["annotations"]["runbook_url"]
        path, _, anchor = url.partition("#")
        assert path == "docs/runbook.md", url
        assert anchor in anchors, f"{alert['alert']}: no section #{anchor} in docs/runbook.md"


def _github_anchor(heading: str) -> str:
    anchor = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
    return anchor


def test_budget_panels_span_the_declared_slo_window() -> None:
    # PromQL ranges cannot read tandem_serving_slo_window_seconds: the dashboard spells the window out.
    from serving.settings import ServingSettings

    window_days = ServingSettings.model_fields["slo_window_days"].default
    budget_panels = [panel for panel in iter_dashboard_panels(DASHBOARD) if "budget left" in panel["title"]]
    assert len(budget_panels) == 2
    for panel in budget_panels:
        assert f"({window_days} d" in panel["title"], panel["title"]
        for target in panel["targets"]:
            ranges = re.findall(r"\[(\d+)([smhdw])\]", target["expr"])
            assert ranges and all(r == (str(window_days), "d") for r in ranges), target["expr"]


def test_slo_numbers_come_from_the_service_not_the_rules() -> None:
    """The availability objective is read from tandem_serving_availability_target, and the latency
    SLI from tandem_serving_requests_over_target_total, not from a bucket that assumes 50 ms."""
    budget = [
        rule
        for group in RULES["groups"]
        for rule in group["rules"]
        if rule.get("record") == "tandem:score_error_budget:ratio"
    ]
    assert len(budget) == 1
    assert "tandem_serving_availability_target" in metric_names(budget[0]["expr"])
    for group in RULES["groups"]:
        for rule in group["rules"]:
            assert 'le="' not in rule["expr"], rule.get("alert") or rule["record"]
            assert "0.001" not in rule["expr"], rule.get("alert") or rule["record"]
            if rule.get("record", "").startswith("tandem:score_slow:"):
                assert "tandem_serving_requests_over_target_total" in metric_names(rule["expr"])
    availability_alerts = [alert for alert in ALERTS if alert["labels"].get("slo") == "score-availability"]
    assert availability_alerts
    for alert in availability_alerts:
        assert "tandem:score_error_budget:ratio" in alert["expr"], alert["alert"]
    exprs = " ".join(expr for _, expr in _dashboard_queries())
    assert "le=" not in exprs.replace("by (le)", ""), "dashboard reads a fixed latency bucket"
    assert "/ 0.001" not in exprs


def test_dashboard_shows_the_new_service_metrics() -> None:
    read = set()
    for _, expr in _dashboard_queries():
        read |= metric_names(substitute_grafana_variables(expr))
    for name in (
        "tandem_serving_items_total",
        "tandem_serving_requests_in_flight",
        "tandem_serving_score_bucket",
        "tandem_serving_requests_over_target_total",
        "tandem_serving_availability_target",
        "tandem_serving_slo_window_seconds",
    ):
        assert name in read, name
