"""Issues #15 and #17, after the backfill: `tandem models promote` marks every scored day stale and
declarative automation rescores those of its window; a challenger is replayed over the week,
judged by `challenger_report`, and its checks and plots are what a browser shows.
"""

from __future__ import annotations

import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import Engine

from inference.store import (
    ResultPath,
    latest_challenger_report,
    predictions,
)
from tests.e2e.browser import screenshot
from tests.e2e.deployment import (
    BIN,
    REPO,
    SENSOR_INTERVAL_SECONDS,
    Deployment,
)
from tests.e2e.graphql import (
    DATA_VERSION,
    FAILED_RUN_STATUSES,
    LAUNCH_RUN,
    SENSOR_RUNS_TIMEOUT_S,
    Repository,
    assert_nothing_requested_after,
    assets_of,
    list_runs,
    requested_at,
    run_errors,
    run_tags,
    wait_for_first_run,
    wait_for_production_model,
    wait_for_runs_covering,
    wait_until_settled,
)
from tests.e2e.week import (
    PARTITIONS,
    SCORING_ASSETS,
    BackfillOutcome,
    partition_staleness,
    promotion_window,
    run_asset_backfill,
)
from tests.shared import run_child

# The deployment and the backfill are set up inside the budget of the first test that asks for them.
pytestmark = [pytest.mark.e2e, pytest.mark.live, pytest.mark.postgres, pytest.mark.timeout(900)]

CHALLENGER_CHECKS = ["challenger_auc_not_worse", "challenger_precision_not_worse", "enough_labelled_evidence"]


def tandem_cli(deployment: Deployment, *args: str) -> str:
    """The CLI as an operator runs it, against the deployment's model store."""
    completed = run_child([str(BIN / "tandem"), *args], cwd=REPO, env=deployment.env, timeout_s=120)
    assert completed.returncode == 0, completed.stderr[-3000:]
    return completed.stdout


def _register_candidate(deployment: Deployment, role: str = "--candidate") -> str:
    completed = run_child(
        [sys.executable, "-m", "tests.e2e.model_setup", role], cwd=REPO, env=deployment.env, timeout_s=180
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    return completed.stdout.strip().splitlines()[-1]


def test_a_promotion_marks_the_scored_days_stale_and_automation_rescores_its_window(
    deployment: Deployment, backfill: BackfillOutcome, repository: Repository, engine: Engine
) -> None:
    automation = "scoring_automation_sensor"
    assert repository.sensors.get(automation) == "RUNNING", repository.sensors
    assert repository.sensors.get("production_model_observer") == "RUNNING", repository.sensors
    before = partition_staleness(deployment)
    assert all(state == ("FRESH", []) for state in before.values()), before
    previous = deployment.production_tag

    candidate = _register_candidate(deployment)
    # The late-records rescores wrote predictions alone, so automation follows them with
    # path_agreement runs of its own; they are over before the promotion, which is what is checked here.
    promoted_at = wait_until_settled(deployment, repository, automation)
    assert f"production -> {candidate}" in tandem_cli(deployment, "models", "promote", candidate)
    wait_for_production_model(deployment, candidate)
    automated = [{"key": "tandem/trigger", "value": "automation"}]

    def since_promotion() -> list[dict[str, Any]]:
        return [run for run in list_runs(deployment, tags=automated) if run["creationTime"] >= promoted_at]

    # The window ends on the UTC day of the tick that evaluated the promotion, read off that tick:
    # a suite that crosses midnight rescores one day fewer than on the day it started or promoted.
    first = wait_for_first_run(deployment, repository, automation, since_promotion, promoted_at)
    evaluated_on = datetime.fromtimestamp(
        min(requested_at(deployment, repository, automation, run) for run in first), UTC
    )
    rescored, left_stale = promotion_window(deployment.rescore_window_days, evaluated_on.date())
    runs = wait_for_runs_covering(deployment, since_promotion, rescored, "the promotion's rescore by automation")
    # Each promotion is handled once.
    assert_nothing_requested_after(deployment, repository, automation, runs, timeout=120)
    runs = since_promotion()
    # Exactly the scored days of the window, one run each, predictions and path_agreement together.
    described = [
        (run_tags(run)["dagster/partition"], assets_of(run), run["creationTime"] - promoted_at) for run in runs
    ]
    assert sorted(run_tags(run)["dagster/partition"] for run in runs) == rescored, described
    assert all(assets_of(run) == SCORING_ASSETS for run in runs), [assets_of(run) for run in runs]
    assert {run_tags(run)["dagster/sensor_name"] for run in runs} == {automation}

    # What the UI shows: the window fresh again, the days before it stale because the model moved.
    staleness = partition_staleness(deployment)
    for partition in rescored:
        assert staleness[partition] == ("FRESH", []), partition
    for partition in left_stale:
        assert staleness[partition] == ("STALE", ["production_model: has a new data version"]), partition

    p = predictions.c
    with engine.connect() as conn:
        versions = {
            partition: set(
                conn.execute(
                    sa.select(p.model_version)
                    .distinct()
                    .where(p.partition_key == partition, p.path == ResultPath.BATCH.value)
                ).scalars()
            )
            for partition in PARTITIONS
        }
    for partition in rescored:  # both answers kept: the old model's and the new one's
        assert versions[partition] == {previous, candidate}, partition
    for partition in left_stale:
        assert versions[partition] == {previous}, partition


def test_a_challenger_is_replayed_over_the_week_and_its_report_plotted(
    deployment: Deployment,
    backfill: BackfillOutcome,
    repository: Repository,
    engine: Engine,
    browser_page: Any,
    screenshots: Path,
) -> None:
    """The rollout an operator runs from the UI: set a challenger, backfill challenger_predictions
    over the week, materialize challenger_report; its gate checks are evaluated, its numbers
    are plotted on the asset's Plots tab, and production's answers are untouched."""
    (production_node,) = deployment.graphql(DATA_VERSION, path=["production_model"])["assetNodes"]
    production = production_node["dataVersion"]  # the promotion test moved it from deployment.production_tag
    batch_rows = sa.select(sa.func.count()).select_from(predictions).where(predictions.c.path == "batch")
    with engine.connect() as conn:
        before = conn.execute(batch_rows).scalar_one()
    challenger = _register_candidate(deployment, "--challenger")
    assert f"challenger -> {challenger}" in tandem_cli(deployment, "models", "challenge", challenger)

    def observed() -> bool | None:
        (node,) = deployment.graphql(DATA_VERSION, path=["challenger_model"])["assetNodes"]
        return True if node["dataVersion"] == challenger else None

    deployment.wait_until("challenger_model observed", observed, timeout=20 * SENSOR_INTERVAL_SECONDS)
    replay = run_asset_backfill(deployment, ["challenger_predictions"], "e2e: replay the challenger")
    assert len(replay.runs) == len(PARTITIONS) and all(run["status"] == "SUCCESS" for run in replay.runs)

    launched = deployment.graphql(
        LAUNCH_RUN,
        executionParams={
            # What the UI's Materialize button on the asset sends: the asset job, the asset and its checks.
            "selector": {
                **repository.selector(),
                "jobName": "__ASSET_JOB",
                "assetSelection": [{"path": ["challenger_report"]}],
                "assetCheckSelection": [
                    {"assetKey": {"path": ["challenger_report"]}, "name": name} for name in CHALLENGER_CHECKS
                ],
            },
        },
    )["launchRun"]
    assert launched["__typename"] == "LaunchRunSuccess", launched
    run_id = launched["run"]["runId"]

    def finished() -> dict[str, Any] | None:
        (run,) = list_runs(deployment, runIds=[run_id])
        return run if run["status"] in {"SUCCESS", *FAILED_RUN_STATUSES} else None

    run = deployment.wait_until("challenger_report", finished, timeout=SENSOR_RUNS_TIMEOUT_S)
    assert run["status"] == "SUCCESS", run_errors(deployment, [run_id])
    p = predictions.c
    with engine.connect() as conn:
        assert conn.execute(batch_rows).scalar_one() == before, "a replay wrote to predictions"
        report = latest_challenger_report(conn, challenger=challenger, champion=production)
        champion_days = set(
            conn.execute(
                sa.select(p.partition_key).distinct().where(p.model_version == production, p.path == "batch")
            ).scalars()
        )
    assert report is not None and report.run_id == run_id
    # Compared where both versions answered: after the promotion test, the champion has batch
    # answers only for the days automation rescored.
    assert report.metrics["pairs"] > 0 and report.metrics["days"] == len(champion_days)

    page = browser_page
    page.set_viewport_size({"width": 1600, "height": 1400})
    page.goto(f"{deployment.url}/assets/challenger_report?view=checks", timeout=60_000)
    for check in CHALLENGER_CHECKS:
        page.get_by_text(check, exact=True).first.wait_for(state="visible", timeout=60_000)
    screenshot(page, screenshots, "challenger-report-checks.png")
    # The overview's Metadata section, switched from Table to Plots: one plot per number, across
    # materializations.
    page.goto(f"{deployment.url}/assets/challenger_report", timeout=60_000)
    plots = page.get_by_role("button", name="Plots")
    plots.first.wait_for(state="visible", timeout=60_000)
    plots.first.click()
    try:
        for number in ("challenger_auc", "champion_auc", "decision_flips", "score_difference_p99"):
            page.get_by_text(number, exact=True).first.wait_for(state="visible", timeout=60_000)
        assert page.locator("canvas").count() >= 4
    finally:
        screenshot(page, screenshots, "challenger-report-plots.png")
    assert "challenger cleared" in tandem_cli(deployment, "models", "challenge", "--clear")
