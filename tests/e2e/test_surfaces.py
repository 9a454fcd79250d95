"""Issue #15, what an operator sees once the day is done: a failed run posted to the alert webhook,
and in a real browser the stale marker the promotion left, the asset checks, the score
distribution, and one model feeding both paths in the asset graph.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.browser import screenshot
from tests.e2e.deployment import (
    Deployment,
    WebhookReceiver,
)
from tests.e2e.graphql import (
    ASSET_GRAPH,
    LAUNCH_RUN,
    Repository,
    asset_key_text,
    list_runs,
)
from tests.e2e.week import (
    PARTITIONS,
    BackfillOutcome,
)

# The deployment and the backfill are set up inside the budget of the first test that asks for them.
pytestmark = [pytest.mark.e2e, pytest.mark.live, pytest.mark.postgres, pytest.mark.timeout(900)]

# The reference spec's ingest job: its name predates decision 0012 and must not change.
INGEST_JOB = "ingest_transactions"
FAILING_PARTITION = "2026-11-20"  # its ingest reads a landing folder with no file for it
PREDICTIONS_CHECKS = [
    "batch_answers_current",
    "parity_with_online",
    "reject_rate_bounded",
    "rows_accounted_for",
    "scores_in_unit_interval",
    "unseen_vocabulary_share",
]


def test_a_failed_run_is_posted_to_the_alert_webhook(
    deployment: Deployment, repository: Repository, alert_receiver: WebhookReceiver
) -> None:
    """A real failure through the daemon: an ingest of a day whose file is missing."""
    launched = deployment.graphql(
        LAUNCH_RUN,
        executionParams={
            "selector": {**repository.selector(), "jobName": INGEST_JOB},
            "runConfigData": {
                "resources": {"source": {"config": {"kind": "files", "location": "/nonexistent/landing"}}}
            },
            "executionMetadata": {"tags": [{"key": "dagster/partition", "value": FAILING_PARTITION}]},
        },
    )["launchRun"]
    assert launched["__typename"] == "LaunchRunSuccess", launched
    run_id = launched["run"]["runId"]

    def alerted() -> dict[str, Any] | None:
        return next((alert for alert in alert_receiver.received if alert.get("run_id") == run_id), None)

    alert = deployment.wait_until("the failure alert", alerted, timeout=180, interval=2)
    assert alert["job"] == INGEST_JOB
    assert alert["partition"] == FAILING_PARTITION
    assert alert["url"] == f"{deployment.url}/runs/{run_id}"
    assert f"no file for {FAILING_PARTITION}" in " ".join(step["error"] for step in alert["step_errors"]), alert
    (run,) = [run for run in list_runs(deployment, runIds=[run_id])]
    assert run["status"] == "FAILURE"
    assert len([a for a in alert_receiver.received if a.get("run_id") == run_id]) == 1, "one alert per failed run"


def test_the_ui_shows_the_stale_marker_the_checks_and_the_score_distribution(
    deployment: Deployment, backfill: BackfillOutcome, browser_page: Any, screenshots: Path
) -> None:
    """After the promotion test: a day before the window, on its partition page, is marked
    Unsynced with the cause, beside its score deciles and histogram; the checks tab lists the six
    checks, passed."""
    page = browser_page
    stale_day = PARTITIONS[0]  # before the window, whichever day automation evaluated the promotion on
    page.set_viewport_size({"width": 1600, "height": 1700})  # the marker and the histogram on one screen
    page.goto(f"{deployment.url}/assets/predictions?view=partitions&partition={stale_day}", timeout=60_000)
    marker = page.get_by_text(re.compile(r"^Unsynced \(1\)$")).first
    marker.wait_for(state="visible", timeout=90_000)
    for label in ("score_deciles", "score_histogram", "dagster/row_count", "rejected_by_reason"):
        page.get_by_text(label, exact=True).first.wait_for(state="visible", timeout=60_000)
    page.get_by_text("p50", exact=True).first.wait_for(state="visible", timeout=30_000)
    marker.hover()  # the popover names the cause
    page.get_by_text("has a new data version").first.wait_for(state="visible", timeout=30_000)
    assert page.get_by_text("production_model").count() > 0
    screenshot(page, screenshots, "predictions-stale-partition.png")

    page.set_viewport_size({"width": 1600, "height": 1000})
    page.goto(f"{deployment.url}/assets/predictions?view=checks", timeout=60_000)
    for check in PREDICTIONS_CHECKS:
        page.get_by_text(check, exact=True).first.wait_for(state="visible", timeout=60_000)
    assert page.get_by_text("Succeeded", exact=True).count() >= len(PREDICTIONS_CHECKS)
    screenshot(page, screenshots, "predictions-checks.png")


def test_asset_graph_shows_one_model_feeding_both_paths(
    deployment: Deployment, browser_page: Any, screenshots: Path
) -> None:
    nodes = {asset_key_text(node["assetKey"]): node for node in deployment.graphql(ASSET_GRAPH)["assetNodes"]}
    assert {"transactions", "risk_model", "production_model", "predictions", "online_predictions"} <= set(nodes)
    # risk_model trains and moves the production pointer; what is in production feeds both paths.
    assert {asset_key_text(key) for key in nodes["production_model"]["dependencyKeys"]} == {"risk_model"}
    assert {"predictions", "online_predictions"} <= {
        asset_key_text(key) for key in nodes["production_model"]["dependedByKeys"]
    }
    assert {asset_key_text(key) for key in nodes["predictions"]["dependencyKeys"]} == {
        "transactions",
        "production_model",
    }
    assert {asset_key_text(key) for key in nodes["online_predictions"]["dependencyKeys"]} == {"production_model"}
    assert nodes["production_model"]["isObservable"] and nodes["production_model"]["groupName"] == "model"
    assert nodes["predictions"]["groupName"] == "batch"
    assert nodes["online_predictions"]["groupName"] == "online"
    assert nodes["predictions"]["isExecutable"] and nodes["predictions"]["isPartitioned"]
    # Written by the BentoML service, not by a run: Dagster can observe it but not materialize it.
    assert not nodes["online_predictions"]["isExecutable"]

    page = browser_page
    # Six assets in four groups: wide enough that the fitted graph still draws each node's live data.
    page.set_viewport_size({"width": 2400, "height": 1400})
    labels = ["online_predictions", "predictions", "production_model", "risk_model", "transactions"]
    page.goto(f"{deployment.url}/asset-groups", wait_until="domcontentloaded", timeout=60_000)
    graph_nodes = page.locator("svg foreignObject")
    graph_nodes.first.wait_for(state="attached", timeout=90_000)
    if graph_nodes.filter(has_text=re.compile(f"^{labels[0]}")).count() == 0:
        # The global graph opens with its groups collapsed; ⌥E is the UI's "Expand all groups".
        page.keyboard.press("Alt+KeyE")
    for label in labels:
        graph_nodes.filter(has_text=re.compile(f"^{label}")).first.wait_for(state="visible", timeout=60_000)
    drawn = [graph_nodes.nth(index).text_content() or "" for index in range(graph_nodes.count())]
    # Live data (partition status) arrives after the layout; the screenshot should show it.
    try:
        page.get_by_text(re.compile(r"^\d+% filled")).first.wait_for(state="visible", timeout=60_000)
    finally:
        screenshot(page, screenshots, "asset-graph.png")
    for label in labels:
        assert any(re.match(rf"{label}(?!_)", text) for text in drawn), f"{label} not drawn: {drawn}"
    for group in ("agreement", "batch", "challenger", "model", "online"):
        assert group in drawn, f"group {group} not drawn: {drawn}"
    # The challenger path beside production's: its own model pointer, replay and shadow, one report.
    assert {asset_key_text(key) for key in nodes["challenger_model"]["dependedByKeys"]} >= {
        "challenger_predictions",
        "shadow_predictions",
        "challenger_report",
    }
    assert {"predictions", "challenger_predictions", "shadow_predictions"} <= {
        asset_key_text(key) for key in nodes["challenger_report"]["dependencyKeys"]
    }
    assert nodes["challenger_predictions"]["isPartitioned"] and not nodes["shadow_predictions"]["isExecutable"]
