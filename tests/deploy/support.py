"""Shared helpers for the deployment tests: paths, YAML loading, PromQL metric extraction.

Optional validators (`kubernetes-validate`, `promql-parser`, `dagster-k8s`) are imported lazily so
each test can say precisely what it could not check when one is missing.
"""

from __future__ import annotations

import importlib.util
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
SERVICE_DIR = DEPLOY / "service"
MONITORING_DIR = DEPLOY / "monitoring"
DAGSTER_DIR = DEPLOY / "dagster"
DOCS = ROOT / "docs"

# The Kubernetes minor version the manifests target (schemas bundled by kubernetes-validate).
KUBERNETES_VERSION = "1.30"

# Grafana variables and their stand-ins, so dashboard queries parse as plain PromQL.
_GRAFANA_VARIABLES = {
    "$__rate_interval": "5m",
    "$__interval": "1m",
    "$__range": "30d",
    "$pod": ".*",
    "${pod}": ".*",
}

# Functions and keywords a regex fallback must not mistake for metric names.
_PROMQL_WORDS = frozenset(
    {
        "sum", "min", "max", "avg", "count", "stddev", "stdvar", "topk", "bottomk", "quantile",
        "count_values", "group", "by", "without", "on", "ignoring", "group_left", "group_right",
        "and", "or", "unless", "offset", "bool", "rate", "irate", "increase", "delta", "deriv",
        "histogram_quantile", "absent", "vector", "scalar", "time", "max_over_time",
        "min_over_time", "avg_over_time", "sum_over_time", "label_values", "le", "e",
    }
)  # fmt: skip


def has_module(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


def load_yaml_documents(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


def load_yaml(path: Path) -> Any:
    documents = load_yaml_documents(path)
    assert len(documents) == 1, f"{path} should hold exactly one YAML document"
    return documents[0]


def service_manifests() -> dict[str, dict[str, Any]]:
    """Every resource listed in deploy/service/kustomization.yaml, keyed by `Kind/name`."""
    kustomization = load_yaml(SERVICE_DIR / "kustomization.yaml")
    found: dict[str, dict[str, Any]] = {}
    for relative in kustomization["resources"]:
        for document in load_yaml_documents(SERVICE_DIR / relative):
            found[f"{document['kind']}/{document['metadata']['name']}"] = document
    return found


def substitute_grafana_variables(expr: str) -> str:
    for variable, value in _GRAFANA_VARIABLES.items():
        expr = expr.replace(variable, value)
    return expr


def metric_names(expr: str) -> set[str]:
    """Metric names an expression selects: from the AST when promql-parser is installed (which
    also proves the expression parses), else from a conservative regex."""
    if has_module("promql_parser"):
        import promql_parser

        names: set[str] = set()

        def visit(node: Any) -> None:
            if isinstance(node, promql_parser.VectorSelector) and node.name:
                names.add(node.name)

        promql_parser.walk(promql_parser.parse(expr), visit)
        return names
    without_strings = re.sub(r'"[^"]*"', '""', expr)
    without_labels = re.sub(r"\{[^}]*\}|\[[^\]]*\]|\b(?:by|without|on|ignoring)\s*\([^)]*\)", " ", without_strings)
    candidates = re.findall(r"(?<![\w.])([a-zA-Z_:][a-zA-Z0-9_:]*)\b(?!\s*\()", without_labels)
    return {name for name in candidates if name not in _PROMQL_WORDS}


def exported_metric_names() -> set[str]:
    """Every sample name the service's registry exposes (histogram _bucket/_sum/_count, counter
    _total/_created, ...), from a real ServingMetrics instance."""
    from serving.metrics import ServingMetrics

    metrics = ServingMetrics()
    # Touch labelled children so their samples appear in the exposition.
    metrics.latency.labels(status="200").observe(0.01)
    metrics.shed.labels(reason="over_target").inc()
    metrics.item_errors.labels(reason="bad_currency").inc()
    names: set[str] = set()
    for family in metrics.registry.collect():
        names.add(family.name)
        names.update(sample.name for sample in family.samples)
    return names


def iter_dashboard_panels(dashboard: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for panel in dashboard.get("panels", []):
        yield panel
        yield from panel.get("panels", [])
