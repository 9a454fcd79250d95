"""Issue #6: the Dagster deployment end to end, as an operator drives it.

A 7-day backfill launched through the GraphQL API the UI uses scores every partition and quarantines
the poison; corrected source records make the late-records sensor rescore exactly the partitions they touch;
the asset graph, in a real browser, shows one model feeding both the batch and the online path.
"""

from __future__ import annotations

import os
import re
import shutil
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import date
from pathlib import Path
from typing import Any

import polars as pl
import pytest
import sqlalchemy as sa
from sqlalchemy.engine import Engine

from inference.demo import EXPECTED_REASON, day_range
from inference.records import RAW_COLUMNS, hash_inputs, validate
from inference.store import (
    RejectStage,
    ResultPath,
    make_engine,
    predictions,
    read_partition_rows,
    rejected_records,
    transactions,
    upsert_transactions,
)
from orchestration.sensors import DAILY_JOB, RESCORE_JOB
from orchestration.settings import OrchestrationSettings
from tests.e2e.deployment import SENSOR_INTERVAL_SECONDS, Deployment

# The module's deployment and backfill are set up inside the first test's budget.
pytestmark = [pytest.mark.e2e, pytest.mark.live, pytest.mark.postgres, pytest.mark.timeout(900)]

PARTITIONS = [day.isoformat() for day in day_range(date(2026, 11, 1), 7)]
CORRECTED_PARTITIONS = ("2026-11-03", "2026-11-06")
CORRECTIONS_PER_PARTITION = 3
LOCATION = "tandem"  # workspace.yaml
BACKFILL_TIMEOUT_S = 420
SENSOR_RUNS_TIMEOUT_S = 180
FAILED_RUN_STATUSES = {"FAILURE", "CANCELED"}
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]

REPOSITORIES = """
query Repositories {
  repositoriesOrError {
    __typename
    ... on RepositoryConnection {
      nodes { name location { name } sensors { name sensorState { status } } }
    }
    ... on PythonError { message }
  }
}
"""

PARTITION_SETS = """
query PartitionSets($repositorySelector: RepositorySelector!, $pipelineName: String!) {
  partitionSetsOrError(repositorySelector: $repositorySelector, pipelineName: $pipelineName) {
    __typename
    ... on PartitionSets { results { name pipelineName } }
    ... on Error { message }
  }
}
"""

LAUNCH_BACKFILL = """
mutation LaunchBackfill($backfillParams: LaunchBackfillParams!) {
  launchPartitionBackfill(backfillParams: $backfillParams) {
    __typename
    ... on LaunchBackfillSuccess { backfillId }
    ... on Error { message }
    ... on PythonError { stack }
  }
}
"""

BACKFILL = """
query Backfill($backfillId: String!) {
  partitionBackfillOrError(backfillId: $backfillId) {
    __typename
    ... on PartitionBackfill {
      id
      status
      partitionNames
      partitionStatuses { results { partitionName runId runStatus } }
      error { message }
    }
    ... on Error { message }
  }
}
"""

RUNS = """
query Runs($filter: RunsFilter) {
  runsOrError(filter: $filter) {
    __typename
    ... on Runs { results { runId jobName status endTime tags { key value } } }
    ... on Error { message }
  }
}
"""

RUN_ERRORS = """
query RunErrors($runId: ID!) {
  logsForRun(runId: $runId) {
    __typename
    ... on EventConnection { events { __typename ... on MessageEvent { message level stepKey } } }
    ... on Error { message }
  }
}
"""

MATERIALIZATIONS = """
query Materializations($assetKey: AssetKeyInput!, $partitions: [String!]) {
  assetOrError(assetKey: $assetKey) {
    __typename
    ... on Asset { assetMaterializations(partitions: $partitions) { partition runId } }
    ... on Error { message }
  }
}
"""

SENSOR_TICKS = """
query SensorTicks($sensorSelector: SensorSelector!, $afterTimestamp: Float) {
  sensorOrError(sensorSelector: $sensorSelector) {
    __typename
    ... on Sensor {
      sensorState { status ticks(afterTimestamp: $afterTimestamp, limit: 10) { status timestamp runIds skipReason } }
    }
    ... on Error { message }
  }
}
"""

ASSET_GRAPH = """
query AssetGraph {
  assetNodes {
    assetKey { path }
    groupName
    isExecutable
    isPartitioned
    dependencyKeys { path }
    dependedByKeys { path }
  }
}
"""


@dataclass(frozen=True)
class Repository:
    location: str
    name: str
    sensors: dict[str, str]  # name -> status

    def selector(self) -> dict[str, str]:
        return {"repositoryLocationName": self.location, "repositoryName": self.name}


@dataclass(frozen=True)
class BackfillOutcome:
    backfill_id: str
    run_ids: dict[str, str]  # partition key -> the run that materialized it


# ------------------------------------------------------------------ helpers
def _key(asset_key: dict[str, Any]) -> str:
    return "/".join(asset_key["path"])


def _tags(run: dict[str, Any]) -> dict[str, str]:
    return {tag["key"]: tag["value"] for tag in run["tags"]}


def _runs(deployment: Deployment, **run_filter: Any) -> list[dict[str, Any]]:
    result = deployment.graphql(RUNS, filter=run_filter)["runsOrError"]
    assert result["__typename"] == "Runs", result
    return list(result["results"])


def _run_errors(deployment: Deployment, run_ids: list[str]) -> str:
    """The ERROR-level events of each run: what an operator reads on the run page."""
    lines = []
    for run_id in run_ids:
        logs = deployment.graphql(RUN_ERRORS, runId=run_id)["logsForRun"]
        for event in logs.get("events") or []:
            if event.get("level") == "ERROR":
                lines.append(f"{run_id} {event.get('stepKey') or ''}: {event['message'][:1500]}")
    return "\n".join(lines) or "(no error events)"


def _raise_for_failed_runs(deployment: Deployment, runs: list[dict[str, Any]], what: str) -> None:
    failed = [run["runId"] for run in runs if run["status"] in FAILED_RUN_STATUSES]
    if failed:
        raise AssertionError(
            f"{what}: runs {failed} failed\n{_run_errors(deployment, failed)}\n{deployment.diagnostics()}"
        )


def _materialized_partitions(deployment: Deployment, asset: str) -> dict[str, set[str]]:
    result = deployment.graphql(MATERIALIZATIONS, assetKey={"path": [asset]}, partitions=PARTITIONS)["assetOrError"]
    assert result["__typename"] == "Asset", result
    found: dict[str, set[str]] = {}
    for event in result["assetMaterializations"]:
        found.setdefault(event["partition"], set()).add(event["runId"])
    return found


@pytest.fixture(scope="module")
def engine(deployment: Deployment) -> Iterator[Engine]:
    connected = make_engine(deployment.database_url)
    yield connected
    connected.dispose()


@pytest.fixture(scope="module")
def repository(deployment: Deployment) -> Repository:
    result = deployment.graphql(REPOSITORIES)["repositoriesOrError"]
    assert result["__typename"] == "RepositoryConnection", result
    found = [node for node in result["nodes"] if node["location"]["name"] == LOCATION]
    assert len(found) == 1, f"expected one repository in location {LOCATION!r}: {result['nodes']}"
    node = found[0]
    return Repository(
        location=LOCATION,
        name=node["name"],
        sensors={sensor["name"]: sensor["sensorState"]["status"] for sensor in node["sensors"]},
    )


@pytest.fixture(scope="module")
def backfill(deployment: Deployment, repository: Repository) -> BackfillOutcome:
    """A 7-partition backfill of daily_scoring, launched as the UI's "Materialize" dialog does."""
    partition_sets = deployment.graphql(
        PARTITION_SETS, repositorySelector=repository.selector(), pipelineName=DAILY_JOB
    )["partitionSetsOrError"]
    assert partition_sets["__typename"] == "PartitionSets", partition_sets
    assert len(partition_sets["results"]) == 1, partition_sets
    partition_set = partition_sets["results"][0]["name"]

    launched = deployment.graphql(
        LAUNCH_BACKFILL,
        backfillParams={
            "selector": {"partitionSetName": partition_set, "repositorySelector": repository.selector()},
            "partitionNames": PARTITIONS,
            "title": "e2e: seven demo days",
        },
    )["launchPartitionBackfill"]
    assert launched["__typename"] == "LaunchBackfillSuccess", launched
    backfill_id = launched["backfillId"]

    def finished() -> dict[str, Any] | None:
        state = deployment.graphql(BACKFILL, backfillId=backfill_id)["partitionBackfillOrError"]
        assert state["__typename"] == "PartitionBackfill", state
        statuses = state["partitionStatuses"]["results"]
        _raise_for_failed_runs(
            deployment,
            [{"runId": s["runId"], "status": s["runStatus"]} for s in statuses if s["runId"]],
            f"backfill {backfill_id}",
        )
        if state["status"] in ("REQUESTED", "CANCELING", "FAILING"):
            return None
        return dict(state)

    state = deployment.wait_until(f"backfill {backfill_id}", finished, timeout=BACKFILL_TIMEOUT_S, interval=3)
    assert state["status"] == "COMPLETED_SUCCESS", f"{state}\n{deployment.diagnostics()}"
    return BackfillOutcome(
        backfill_id=backfill_id,
        run_ids={s["partitionName"]: s["runId"] for s in state["partitionStatuses"]["results"]},
    )


def _correct_records(engine: Engine, partition: str, count: int) -> dict[str, str]:
    """A source correction: `count` valid records of the day get a new amount. Returns id -> new input hash."""
    day = date.fromisoformat(partition)
    with engine.begin() as conn:
        stored = validate(read_partition_rows(conn, day))
        chosen = stored.filter(pl.col("reject_reason").is_null()).sort("transaction_id").head(count)
        corrected = validate(chosen.select(*RAW_COLUMNS, "label_fraud").with_columns(pl.col("amount") + 1.0))
        assert corrected["reject_reason"].is_null().all(), "a correction must stay a valid record"
        changed = upsert_transactions(conn, corrected, day)
    assert changed == count, f"{partition}: {changed} of {count} corrected rows stored as changes"
    return dict(zip(corrected["transaction_id"].to_list(), hash_inputs(corrected).to_list(), strict=True))


def _history_readers(engine: Engine, corrected: set[str], history_length: int) -> dict[str, str]:
    """Records whose features read a corrected record as history: the account's next
    `history_length` valid records. Returns transaction id -> partition."""
    t = transactions.c
    with engine.connect() as conn:
        rows = conn.execute(
            sa.select(t.transaction_id, t.account_id, t.partition_date)
            .where(t.reject_reason.is_(None))
            .order_by(t.account_id, t.event_ts, t.transaction_id)
        ).all()
    readers: dict[str, str] = {}
    for position, (transaction_id, account_id, _) in enumerate(rows):
        if transaction_id not in corrected:
            continue
        for later_id, later_account, later_day in rows[position + 1 : position + 1 + history_length]:
            if later_account == account_id:
                readers[later_id] = str(later_day)
    return readers


# ------------------------------------------------------------------ the tests
def test_backfill_scores_every_partition_and_quarantines_the_poison(
    deployment: Deployment, backfill: BackfillOutcome, engine: Engine
) -> None:
    assert sorted(backfill.run_ids) == PARTITIONS

    # What the UI shows: every partition of both assets materialized, by this backfill's runs.
    for asset in ("transactions", "predictions"):
        materialized = _materialized_partitions(deployment, asset)
        assert sorted(materialized) == PARTITIONS, f"{asset}: {sorted(materialized)}"
        for partition, run_ids in materialized.items():
            assert run_ids == {backfill.run_ids[partition]}, f"{asset}[{partition}] materialized by {run_ids}"

    backfill_runs = _runs(deployment, tags=[{"key": "dagster/backfill", "value": backfill.backfill_id}])
    assert len(backfill_runs) == len(PARTITIONS)
    for run in backfill_runs:
        assert run["jobName"] == DAILY_JOB
        assert run["status"] == "SUCCESS"

    # What the tables hold: each day fully accounted for, scored by its own run, poison quarantined.
    p, r, t = predictions.c, rejected_records.c, transactions.c
    with engine.connect() as conn:
        for partition in PARTITIONS:
            day = date.fromisoformat(partition)
            stored = conn.execute(sa.select(sa.func.count()).where(t.partition_date == day)).scalar_one()
            scored = conn.execute(
                sa.select(p.run_id, p.model_version, sa.func.count())
                .where(p.partition_key == partition, p.path == ResultPath.BATCH.value)
                .group_by(p.run_id, p.model_version)
            ).all()
            assert [(run_id, version) for run_id, version, _ in scored] == [
                (backfill.run_ids[partition], deployment.production_tag)
            ], f"{partition}: {scored}"
            rejections = conn.execute(
                sa.select(r.stage, r.reason).where(r.partition_key == partition, r.resolved.is_(False))
            ).all()
            quarantined_at_scoring = sum(1 for stage, _ in rejections if stage == RejectStage.SCORE.value)
            assert scored[0][2] > 0
            assert scored[0][2] + quarantined_at_scoring == stored, f"{partition}: scored + rejected != stored"
            # 1% poison of 1000 rows cycles through every poison kind, so each day has each reason.
            reasons = Counter(reason for _, reason in rejections)
            assert set(reasons) == {reason.value for reason in EXPECTED_REASON.values()}, f"{partition}: {reasons}"


def test_corrected_records_rescore_exactly_the_partitions_they_touch(
    deployment: Deployment, backfill: BackfillOutcome, repository: Repository, engine: Engine
) -> None:
    """A correction makes stale its own score and the scores of the records that read it as
    history; the sensor reruns exactly those records' partitions, and only they are rewritten."""
    sensor = "late_records_sensor"
    assert repository.sensors.get(sensor) == "RUNNING", repository.sensors
    assert not _runs(deployment, tags=[{"key": "tandem/trigger", "value": "late_records"}]), "runs before any change"

    new_hashes = {
        partition: _correct_records(engine, partition, CORRECTIONS_PER_PARTITION) for partition in CORRECTED_PARTITIONS
    }
    corrected = {tid for hashes in new_hashes.values() for tid in hashes}
    readers = _history_readers(engine, corrected, OrchestrationSettings().history_length)
    touched = sorted(set(CORRECTED_PARTITIONS) | set(readers.values()))

    def rescored() -> list[dict[str, Any]] | None:
        runs = _runs(deployment, tags=[{"key": "tandem/trigger", "value": "late_records"}])
        _raise_for_failed_runs(deployment, runs, "late-records rescoring")
        partitions = {_tags(run).get("dagster/partition") for run in runs}
        done = all(run["status"] == "SUCCESS" for run in runs)
        return runs if done and partitions >= set(touched) else None

    runs = deployment.wait_until("late-records runs", rescored, timeout=SENSOR_RUNS_TIMEOUT_S)

    # One more evaluation after the reruns finished must request nothing: each change is requested once.
    after = max(run["endTime"] for run in runs)
    selector = {**repository.selector(), "sensorName": sensor}

    def next_tick() -> list[dict[str, Any]] | None:
        state = deployment.graphql(SENSOR_TICKS, sensorSelector=selector, afterTimestamp=after)["sensorOrError"]
        assert state["__typename"] == "Sensor", state
        ticks = [tick for tick in state["sensorState"]["ticks"] if tick["status"] != "STARTED"]
        return ticks or None

    ticks = deployment.wait_until(
        f"a {sensor} tick after the reruns", next_tick, timeout=10 * SENSOR_INTERVAL_SECONDS, interval=1
    )
    assert all(not tick["runIds"] for tick in ticks), ticks

    runs = _runs(deployment, tags=[{"key": "tandem/trigger", "value": "late_records"}])
    by_partition = {_tags(run)["dagster/partition"]: run for run in runs}
    assert sorted(by_partition) == touched, [_tags(run) for run in runs]
    assert len(runs) == len(touched), "one run per touched partition"
    for run in runs:
        assert run["jobName"] == RESCORE_JOB
        assert run["status"] == "SUCCESS"
        assert _tags(run)["tandem/model_version"] == deployment.production_tag

    p = predictions.c
    with engine.connect() as conn:
        for partition in PARTITIONS:
            rows = conn.execute(
                sa.select(p.transaction_id, p.input_hash, p.run_id).where(
                    p.partition_key == partition,
                    p.path == ResultPath.BATCH.value,
                    p.model_version == deployment.production_tag,
                )
            ).all()
            changed = new_hashes.get(partition, {})
            stale = {tid for tid, day in readers.items() if day == partition} | set(changed)
            writers = Counter(run_id for transaction_id, _, run_id in rows if transaction_id not in stale)
            # Untouched records keep the backfill's result: a rerun rewrites only what changed.
            assert set(writers) == {backfill.run_ids[partition]}, f"{partition}: {writers}"
            rescored_rows = {tid: (input_hash, run_id) for tid, input_hash, run_id in rows if tid in changed}
            assert rescored_rows == {
                tid: (input_hash, by_partition[partition]["runId"]) for tid, input_hash in changed.items()
            }, f"{partition}: corrected records not rescored with their new input"
            rescored_readers = {run_id for tid, _, run_id in rows if tid in stale and tid not in changed}
            assert rescored_readers <= {by_partition.get(partition, {}).get("runId")}, (
                f"{partition}: records that read a corrected record as history kept stale scores"
            )


def _chromium() -> str:
    path = os.environ.get("TANDEM_E2E_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
    if not Path(path).exists():
        pytest.fail("Chromium not found: apt-get install -y chromium (or set TANDEM_E2E_CHROMIUM)")
    return path


def _render_asset_graph(url: str, screenshot: Path, labels: list[str]) -> list[str]:
    """Load the global asset graph in headless Chromium, wait for its nodes, screenshot it.

    Returns the text of every node drawn in the graph (the SVG's foreignObjects: groups and assets).
    """
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.fail("playwright is not installed: pip install playwright (the wheel carries its driver)")
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=_chromium(), args=CHROMIUM_ARGS, headless=True)
        try:
            page = browser.new_page(viewport={"width": 1600, "height": 1000})
            page.goto(f"{url}/asset-groups", wait_until="domcontentloaded", timeout=60_000)
            graph_nodes = page.locator("svg foreignObject")
            graph_nodes.first.wait_for(state="attached", timeout=90_000)
            if graph_nodes.filter(has_text=re.compile(f"^{labels[0]}")).count() == 0:
                # The global graph opens with its groups collapsed; ⌥E is the UI's "Expand all groups".
                page.keyboard.press("Alt+KeyE")
            for label in labels:
                graph_nodes.filter(has_text=re.compile(f"^{label}")).first.wait_for(state="visible", timeout=60_000)
            # Live data (partition fill) arrives after the layout; the screenshot should show it.
            page.get_by_text(re.compile(r"^\d+% filled$")).first.wait_for(state="visible", timeout=60_000)
            page.screenshot(path=str(screenshot))
            return [graph_nodes.nth(index).text_content() or "" for index in range(graph_nodes.count())]
        finally:
            browser.close()


def test_asset_graph_shows_one_model_feeding_both_paths(deployment: Deployment, artifacts_dir: Path) -> None:
    nodes = {_key(node["assetKey"]): node for node in deployment.graphql(ASSET_GRAPH)["assetNodes"]}
    assert {"transactions", "risk_model", "predictions", "online_predictions"} <= set(nodes), sorted(nodes)
    downstream_of_model = {_key(key) for key in nodes["risk_model"]["dependedByKeys"]}
    assert {"predictions", "online_predictions"} <= downstream_of_model
    assert {_key(key) for key in nodes["predictions"]["dependencyKeys"]} == {"transactions", "risk_model"}
    assert {_key(key) for key in nodes["online_predictions"]["dependencyKeys"]} == {"risk_model"}
    assert nodes["predictions"]["groupName"] == "batch"
    assert nodes["online_predictions"]["groupName"] == "online"
    assert nodes["predictions"]["isExecutable"] and nodes["predictions"]["isPartitioned"]
    # Written by the BentoML service, not by a run: Dagster can observe it but not materialize it.
    assert not nodes["online_predictions"]["isExecutable"]

    # The onboarding dialog ("Join the Dagster community") would cover the graph; this is its Skip.
    assert deployment.graphql("mutation { setNuxSeen }")["setNuxSeen"] is True
    labels = ["online_predictions", "predictions", "risk_model", "transactions"]
    screenshot = artifacts_dir / "asset-graph.png"
    screenshot.unlink(missing_ok=True)
    drawn = _render_asset_graph(deployment.url, screenshot, labels)
    for label in labels:
        assert any(re.match(rf"{label}(?!_)", text) for text in drawn), f"{label} not drawn: {drawn}"
    for group in ("batch", "model", "online"):
        assert group in drawn, f"group {group} not drawn: {drawn}"
    assert screenshot.stat().st_size > 10_000
