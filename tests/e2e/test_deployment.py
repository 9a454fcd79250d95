"""Issues #6 and #15: the Dagster deployment end to end, as an operator drives it, through the
GraphQL API the UI uses and the `tandem` CLI.

The week is ingested, then the backfill the README describes (an asset backfill of `predictions`
and `path_agreement` over a date range) scores every day and quarantines the poison, never running
more runs than `max_concurrent_runs` or more `database` steps than the pool allows. Corrected source
records make the late-records sensor rescore exactly the partitions they touch. `tandem models
promote` marks every scored day stale, and declarative automation rescores those of its window. A
failed run is posted to the alert webhook. A real browser shows the stale marker, the asset checks,
the score distribution and one model feeding both paths.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import date
from pathlib import Path
from typing import Any

import polars as pl
import pytest
import sqlalchemy as sa
import yaml
from sqlalchemy.engine import Engine

from inference.demo import EXPECTED_REASON, day_range
from inference.records import RAW_COLUMNS, hash_inputs, validate
from inference.store import (
    RejectStage,
    ResultPath,
    latest_challenger_report,
    make_engine,
    predictions,
    read_partition_rows,
    rejected_records,
    transactions,
    upsert_transactions,
)
from orchestration.sensors import INGEST_JOB, RESCORE_JOB
from orchestration.settings import OrchestrationSettings
from tests.e2e.deployment import (
    BIN,
    REPO,
    RESCORE_FROM,
    SENSOR_INTERVAL_SECONDS,
    Deployment,
    WebhookReceiver,
    keep_screenshot,
)

# The module's deployment and backfill are set up inside the first test's budget.
pytestmark = [pytest.mark.e2e, pytest.mark.live, pytest.mark.postgres, pytest.mark.timeout(900)]

PARTITIONS = [day.isoformat() for day in day_range(date(2026, 11, 1), 7)]
# After the promotion: inside the automation window and rescored, or before it and left stale.
RESCORED = [key for key in PARTITIONS if date.fromisoformat(key) >= RESCORE_FROM]
LEFT_STALE = [key for key in PARTITIONS if key not in RESCORED]
CORRECTED_PARTITIONS = ("2026-11-03", "2026-11-06")
CORRECTIONS_PER_PARTITION = 3
FAILING_PARTITION = "2026-11-20"  # its ingest reads a landing folder with no file for it
LOCATION = "tandem"  # workspace.yaml
SCORING_ASSETS = ["path_agreement", "predictions"]  # the README's backfill (sorted, as _assets_of lists them)
DATABASE_POOL = "database"
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
CHALLENGER_CHECKS = ["challenger_auc_not_worse", "challenger_precision_not_worse", "enough_labelled_evidence"]
PREDICTIONS_CHECKS = [
    "batch_answers_current",
    "parity_with_online",
    "reject_rate_bounded",
    "rows_accounted_for",
    "scores_in_unit_interval",
    "unseen_vocabulary_share",
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

# What the UI's "Materialize… -> Launch backfill" sends for assets: a selection and partition names.
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
    ... on PartitionBackfill { id status isAssetBackfill error { message } }
    ... on Error { message }
  }
}
"""

RUNS = """
query Runs($filter: RunsFilter) {
  runsOrError(filter: $filter) {
    __typename
    ... on Runs {
      results {
        runId jobName status creationTime startTime endTime
        tags { key value }
        assetSelection { path }
        stepStats { stepKey status startTime endTime }
      }
    }
    ... on Error { message }
  }
}
"""

RUN_EVENTS = """
query RunEvents($runId: ID!) {
  logsForRun(runId: $runId) {
    __typename
    ... on EventConnection { events { __typename ... on MessageEvent { message level stepKey timestamp } } }
    ... on Error { message }
  }
}
"""

LAUNCH_RUN = """
mutation LaunchRun($executionParams: ExecutionParams!) {
  launchRun(executionParams: $executionParams) {
    __typename
    ... on LaunchRunSuccess { run { runId } }
    ... on RunConfigValidationInvalid { errors { message } }
    ... on Error { message }
    ... on PythonError { message }
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

STALENESS = """
query Staleness($partitions: [String!]!) {
  assetNodes(assetKeys: [{path: ["predictions"]}]) {
    staleStatusByPartition(partitions: $partitions)
    staleCausesByPartition(partitions: $partitions) { reason category key { path } }
  }
}
"""

DATA_VERSION = """
query DataVersion($path: [String!]!) { assetNodes(assetKeys: [{path: $path}]) { dataVersion } }
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
    isObservable
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
    runs: list[dict[str, Any]]
    materialized_by: dict[str, dict[str, str]]  # asset -> partition key -> the run that materialized it


# ------------------------------------------------------------------ helpers
def _key(asset_key: dict[str, Any]) -> str:
    return "/".join(asset_key["path"])


def _tags(run: dict[str, Any]) -> dict[str, str]:
    return {tag["key"]: tag["value"] for tag in run["tags"]}


def _assets_of(run: dict[str, Any]) -> list[str]:
    return sorted(_key(key) for key in run["assetSelection"] or [])


def _runs(deployment: Deployment, **run_filter: Any) -> list[dict[str, Any]]:
    result = deployment.graphql(RUNS, filter=run_filter)["runsOrError"]
    assert result["__typename"] == "Runs", result
    return list(result["results"])


def _run_events(deployment: Deployment, run_id: str) -> list[dict[str, Any]]:
    logs = deployment.graphql(RUN_EVENTS, runId=run_id)["logsForRun"]
    assert logs["__typename"] == "EventConnection", logs
    return list(logs["events"])


def _run_errors(deployment: Deployment, run_ids: list[str]) -> str:
    """The ERROR-level events of each run: what an operator reads on the run page."""
    lines = []
    for run_id in run_ids:
        for event in _run_events(deployment, run_id):
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


def _peak(intervals: list[tuple[float, float]]) -> int:
    """The most intervals open at one moment (one that ends as another starts does not overlap it)."""
    edges = sorted([(start, 1) for start, _ in intervals] + [(end, -1) for _, end in intervals])
    open_now = peak = 0
    for _, step in edges:
        open_now += step
        peak = max(peak, open_now)
    return peak


def _quiet_tick_after(
    deployment: Deployment, repository: Repository, sensor: str, after: float, *, timeout: float
) -> list[dict[str, Any]]:
    """The sensor's evaluations that ended after `after`, once there is at least one."""
    selector = {**repository.selector(), "sensorName": sensor}

    def ticks_after() -> list[dict[str, Any]] | None:
        state = deployment.graphql(SENSOR_TICKS, sensorSelector=selector, afterTimestamp=after)["sensorOrError"]
        assert state["__typename"] == "Sensor", state
        ticks = [tick for tick in state["sensorState"]["ticks"] if tick["status"] != "STARTED"]
        return ticks or None

    return deployment.wait_until(f"a {sensor} tick after {after:.0f}", ticks_after, timeout=timeout, interval=1)


def _wait_until_settled(deployment: Deployment, repository: Repository, sensor: str) -> float:
    """Every run over and one evaluation of `sensor` since then that requested nothing: what the
    earlier tests set going (path_agreement after a late-records rescore) is done. Returns that time."""

    def settled() -> float | None:
        runs = _runs(deployment)
        if any(run["endTime"] is None for run in runs):
            return None
        quiet_since = max((run["endTime"] for run in runs), default=0.0)
        selector = {**repository.selector(), "sensorName": sensor}
        state = deployment.graphql(SENSOR_TICKS, sensorSelector=selector, afterTimestamp=quiet_since)
        ticks = [tick for tick in state["sensorOrError"]["sensorState"]["ticks"] if tick["status"] != "STARTED"]
        return time.time() if ticks and all(not tick["runIds"] for tick in ticks) else None

    return deployment.wait_until(f"no run left for {sensor} to start", settled, timeout=SENSOR_RUNS_TIMEOUT_S)


def _run_asset_backfill(deployment: Deployment, assets: list[str], title: str) -> BackfillOutcome:
    launched = deployment.graphql(
        LAUNCH_BACKFILL,
        backfillParams={
            "assetSelection": [{"path": [asset]} for asset in assets],
            "partitionNames": PARTITIONS,
            "title": title,
        },
    )["launchPartitionBackfill"]
    assert launched["__typename"] == "LaunchBackfillSuccess", launched
    backfill_id = launched["backfillId"]
    backfill_tag = [{"key": "dagster/backfill", "value": backfill_id}]

    def finished() -> dict[str, Any] | None:
        state = deployment.graphql(BACKFILL, backfillId=backfill_id)["partitionBackfillOrError"]
        assert state["__typename"] == "PartitionBackfill" and state["isAssetBackfill"], state
        _raise_for_failed_runs(deployment, _runs(deployment, tags=backfill_tag), f"backfill {backfill_id}")
        return None if state["status"] in ("REQUESTED", "CANCELING", "FAILING") else dict(state)

    state = deployment.wait_until(f"backfill {backfill_id}", finished, timeout=BACKFILL_TIMEOUT_S, interval=3)
    assert state["status"] == "COMPLETED_SUCCESS", f"{state}\n{deployment.diagnostics()}"
    materialized_by = {}
    backfill_runs = _runs(deployment, tags=backfill_tag)
    ours = {run["runId"] for run in backfill_runs}
    # The demo's ingest writes each day's file while its run is in flight: the landing sensor sees
    # the asset backfill's run (tagged with a partition range, not dagster/partition) and waits.
    landing_runs = _runs(deployment, tags=[{"key": "tandem/trigger", "value": "landing"}])
    assert not landing_runs, [_tags(run) for run in landing_runs]
    for asset in assets:
        materialized = _materialized_partitions(deployment, asset)
        assert sorted(materialized) == PARTITIONS, f"{asset}: {sorted(materialized)}"
        assert all(len(run_ids) == 1 and run_ids <= ours for run_ids in materialized.values()), (
            f"{asset}: {materialized}"
        )
        materialized_by[asset] = {partition: run_ids.pop() for partition, run_ids in materialized.items()}
    return BackfillOutcome(backfill_id, backfill_runs, materialized_by)


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


def _wait_for_production_model(deployment: Deployment, tag: str) -> None:
    def observed() -> bool | None:
        (node,) = deployment.graphql(DATA_VERSION, path=["production_model"])["assetNodes"]
        return True if node["dataVersion"] == tag else None

    deployment.wait_until(f"production_model observed at {tag}", observed, timeout=20 * SENSOR_INTERVAL_SECONDS)


@pytest.fixture(scope="module")
def ingested(deployment: Deployment, repository: Repository) -> BackfillOutcome:
    """The fresh deployment's week, ingested: an asset backfill of `transactions`."""
    # Scoring records which production model it read; the observer reports it within a tick.
    _wait_for_production_model(deployment, deployment.production_tag)
    return _run_asset_backfill(deployment, ["transactions"], "e2e: ingest the demo week")


@pytest.fixture(scope="module")
def backfill(deployment: Deployment, ingested: BackfillOutcome) -> BackfillOutcome:
    """The README's backfill: predictions and path_agreement over the week, as the UI launches it."""
    return _run_asset_backfill(deployment, SCORING_ASSETS, "e2e: score the demo week")


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
def test_the_readme_backfill_scores_every_partition_and_quarantines_the_poison(
    deployment: Deployment, ingested: BackfillOutcome, backfill: BackfillOutcome, engine: Engine
) -> None:
    # One run per partition (BackfillPolicy.multi_run(1)), each day's two assets in the same run.
    assert len(backfill.runs) == len(PARTITIONS)
    for run in backfill.runs:
        assert run["status"] == "SUCCESS"
        assert _assets_of(run) == SCORING_ASSETS
    for partition in PARTITIONS:
        assert (
            backfill.materialized_by["predictions"][partition] == backfill.materialized_by["path_agreement"][partition]
        )
    assert {run["runId"] for run in backfill.runs} == set(backfill.materialized_by["predictions"].values())
    assert all(_assets_of(run) == ["transactions"] for run in ingested.runs) and len(ingested.runs) == len(PARTITIONS)

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
                (backfill.materialized_by["predictions"][partition], deployment.production_tag)
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


def test_backfill_runs_stay_within_the_run_and_pool_limits(
    deployment: Deployment, ingested: BackfillOutcome, backfill: BackfillOutcome
) -> None:
    """Counted from the runs' and steps' own start and end times: never more runs at once than
    max_concurrent_runs, never more `database` steps than the pool's limit; and the pool did hold
    runs back (the queue launches a run only when its step could get a slot: granularity op)."""
    config = yaml.safe_load((Path(deployment.env["DAGSTER_HOME"]) / "dagster.yaml").read_text())
    max_runs = config["concurrency"]["runs"]["max_concurrent_runs"]
    pool_limit = config["concurrency"]["pools"]["default_limit"]
    runs = [*ingested.runs, *backfill.runs]

    run_spans, step_spans = [], []
    for run in runs:
        events = _run_events(deployment, run["runId"])
        # From the moment the queue let the run go (RUN_STARTING) to its end: what the limit counts.
        launched = min(float(e["timestamp"]) / 1000 for e in events if e["__typename"] == "RunStartingEvent")
        run_spans.append((launched, run["endTime"]))
        # Every step of these runs is in the database pool (tests/orchestration/test_definitions.py).
        step_spans += [(step["startTime"], step["endTime"]) for step in run["stepStats"]]
    assert len(step_spans) == len(ingested.runs) + 2 * len(backfill.runs)

    assert 2 <= _peak(run_spans) <= max_runs, sorted(run_spans)
    assert _peak(step_spans) <= pool_limit, sorted(step_spans)

    # Seven runs queued at once, two slots: the queue held the others back for the pool.
    daemon_log = deployment.service("dagster-daemon").log_path.read_text(errors="replace")
    held = re.findall(r"Run ([0-9a-f-]{36}) is blocked by global concurrency limits: (.*)", daemon_log)
    held_back = {run_id for run_id, detail in held if f'"{DATABASE_POOL}"' in detail}
    assert held_back & {run["runId"] for run in runs}, "the database pool never held a backfill run back"
    assert all(f'"slot_count": {pool_limit}' in detail for _, detail in held), held[:3]


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
    ticks = _quiet_tick_after(deployment, repository, sensor, after, timeout=10 * SENSOR_INTERVAL_SECONDS)
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
            assert set(writers) == {backfill.materialized_by["predictions"][partition]}, f"{partition}: {writers}"
            rescored_rows = {tid: (input_hash, run_id) for tid, input_hash, run_id in rows if tid in changed}
            assert rescored_rows == {
                tid: (input_hash, by_partition[partition]["runId"]) for tid, input_hash in changed.items()
            }, f"{partition}: corrected records not rescored with their new input"
            rescored_readers = {run_id for tid, _, run_id in rows if tid in stale and tid not in changed}
            assert rescored_readers <= {by_partition.get(partition, {}).get("runId")}, (
                f"{partition}: records that read a corrected record as history kept stale scores"
            )


def _tandem(deployment: Deployment, *args: str) -> str:
    """The CLI as an operator runs it, against the deployment's model store."""
    completed = subprocess.run(
        [str(BIN / "tandem"), *args],
        cwd=REPO,
        env=dict(deployment.env),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    return completed.stdout


def _register_candidate(deployment: Deployment, role: str = "--candidate") -> str:
    completed = subprocess.run(
        [sys.executable, "-m", "tests.e2e.model_setup", role],
        cwd=REPO,
        env=dict(deployment.env),
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    return completed.stdout.strip().splitlines()[-1]


def _staleness(deployment: Deployment) -> dict[str, tuple[str, list[str]]]:
    (node,) = deployment.graphql(STALENESS, partitions=PARTITIONS)["assetNodes"]
    return {
        partition: (status, sorted(f"{_key(cause['key'])}: {cause['reason']}" for cause in causes))
        for partition, status, causes in zip(
            PARTITIONS, node["staleStatusByPartition"], node["staleCausesByPartition"], strict=True
        )
    }


def test_a_promotion_marks_the_scored_days_stale_and_automation_rescores_its_window(
    deployment: Deployment, backfill: BackfillOutcome, repository: Repository, engine: Engine
) -> None:
    automation = "scoring_automation_sensor"
    assert repository.sensors.get(automation) == "RUNNING", repository.sensors
    assert repository.sensors.get("production_model_observer") == "RUNNING", repository.sensors
    assert all(state == ("FRESH", []) for state in _staleness(deployment).values()), _staleness(deployment)
    previous = deployment.production_tag

    candidate = _register_candidate(deployment)
    # The late-records rescores wrote predictions alone, so automation follows them with
    # path_agreement runs of its own; they are over before the promotion, which is what is checked here.
    promoted_at = _wait_until_settled(deployment, repository, automation)
    assert f"production -> {candidate}" in _tandem(deployment, "models", "promote", candidate)
    _wait_for_production_model(deployment, candidate)
    automated = [{"key": "tandem/trigger", "value": "automation"}]

    def since_promotion() -> list[dict[str, Any]]:
        return [run for run in _runs(deployment, tags=automated) if run["creationTime"] >= promoted_at]

    def rescored() -> list[dict[str, Any]] | None:
        runs = since_promotion()
        _raise_for_failed_runs(deployment, runs, "automation rescoring")
        partitions = {_tags(run).get("dagster/partition") for run in runs}
        done = all(run["status"] == "SUCCESS" for run in runs)
        return runs if done and partitions >= set(RESCORED) else None

    runs = deployment.wait_until("the promotion's rescore", rescored, timeout=SENSOR_RUNS_TIMEOUT_S)

    # One more automation tick after the rescore requests nothing: each promotion is handled once.
    after = max(run["endTime"] for run in runs)
    ticks = _quiet_tick_after(deployment, repository, automation, after, timeout=120)
    assert all(not tick["runIds"] for tick in ticks), ticks
    runs = since_promotion()
    # Exactly the scored days of the window, one run each, predictions and path_agreement together.
    described = [(_tags(run)["dagster/partition"], _assets_of(run), run["creationTime"] - promoted_at) for run in runs]
    assert sorted(_tags(run)["dagster/partition"] for run in runs) == RESCORED, described
    assert all(_assets_of(run) == SCORING_ASSETS for run in runs), [_assets_of(run) for run in runs]
    assert {_tags(run)["dagster/sensor_name"] for run in runs} == {automation}

    # What the UI shows: the window fresh again, the days before it stale because the model moved.
    staleness = _staleness(deployment)
    for partition in RESCORED:
        assert staleness[partition] == ("FRESH", []), partition
    for partition in LEFT_STALE:
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
    for partition in RESCORED:  # both answers kept: the old model's and the new one's
        assert versions[partition] == {previous, candidate}, partition
    for partition in LEFT_STALE:
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
    assert f"challenger -> {challenger}" in _tandem(deployment, "models", "challenge", challenger)

    def observed() -> bool | None:
        (node,) = deployment.graphql(DATA_VERSION, path=["challenger_model"])["assetNodes"]
        return True if node["dataVersion"] == challenger else None

    deployment.wait_until("challenger_model observed", observed, timeout=20 * SENSOR_INTERVAL_SECONDS)
    replay = _run_asset_backfill(deployment, ["challenger_predictions"], "e2e: replay the challenger")
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
        (run,) = _runs(deployment, runIds=[run_id])
        return run if run["status"] in {"SUCCESS", *FAILED_RUN_STATUSES} else None

    run = deployment.wait_until("challenger_report", finished, timeout=SENSOR_RUNS_TIMEOUT_S)
    assert run["status"] == "SUCCESS", _run_errors(deployment, [run_id])
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
    _screenshot(page, screenshots, "challenger-report-checks.png")
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
        _screenshot(page, screenshots, "challenger-report-plots.png")
    assert "challenger cleared" in _tandem(deployment, "models", "challenge", "--clear")


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
    (run,) = [run for run in _runs(deployment, runIds=[run_id])]
    assert run["status"] == "FAILURE"
    assert len([a for a in alert_receiver.received if a.get("run_id") == run_id]) == 1, "one alert per failed run"


def _chromium() -> str:
    path = os.environ.get("TANDEM_E2E_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
    if not Path(path).exists():
        pytest.fail("Chromium not found: apt-get install -y chromium (or set TANDEM_E2E_CHROMIUM)")
    return path


@pytest.fixture(scope="module")
def browser_page(deployment: Deployment) -> Iterator[Any]:
    """One headless Chromium page on the deployment's UI, its onboarding dialog dismissed."""
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.fail("playwright is not installed: pip install playwright (the wheel carries its driver)")
    # The onboarding dialog ("Join the Dagster community") would cover the page; this is its Skip.
    assert deployment.graphql("mutation { setNuxSeen }")["setNuxSeen"] is True
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=_chromium(), args=CHROMIUM_ARGS, headless=True)
        try:
            yield browser.new_page(viewport={"width": 1600, "height": 1000})
        finally:
            browser.close()


def _screenshot(page: Any, screenshots: Path, name: str) -> Path:
    path = screenshots / name
    page.screenshot(path=str(path))
    keep_screenshot(path)
    assert path.stat().st_size > 10_000
    return path


def test_the_ui_shows_the_stale_marker_the_checks_and_the_score_distribution(
    deployment: Deployment, backfill: BackfillOutcome, browser_page: Any, screenshots: Path
) -> None:
    """After the promotion test: a day before the window, on its partition page, is marked
    Unsynced with the cause, beside its score deciles and histogram; the checks tab lists the six
    checks, passed."""
    page = browser_page
    stale_day = LEFT_STALE[0]
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
    _screenshot(page, screenshots, "predictions-stale-partition.png")

    page.set_viewport_size({"width": 1600, "height": 1000})
    page.goto(f"{deployment.url}/assets/predictions?view=checks", timeout=60_000)
    for check in PREDICTIONS_CHECKS:
        page.get_by_text(check, exact=True).first.wait_for(state="visible", timeout=60_000)
    assert page.get_by_text("Succeeded", exact=True).count() >= len(PREDICTIONS_CHECKS)
    _screenshot(page, screenshots, "predictions-checks.png")


def test_asset_graph_shows_one_model_feeding_both_paths(
    deployment: Deployment, browser_page: Any, screenshots: Path
) -> None:
    nodes = {_key(node["assetKey"]): node for node in deployment.graphql(ASSET_GRAPH)["assetNodes"]}
    assert {"transactions", "risk_model", "production_model", "predictions", "online_predictions"} <= set(nodes)
    # risk_model trains and moves the production pointer; what is in production feeds both paths.
    assert {_key(key) for key in nodes["production_model"]["dependencyKeys"]} == {"risk_model"}
    assert {"predictions", "online_predictions"} <= {_key(key) for key in nodes["production_model"]["dependedByKeys"]}
    assert {_key(key) for key in nodes["predictions"]["dependencyKeys"]} == {"transactions", "production_model"}
    assert {_key(key) for key in nodes["online_predictions"]["dependencyKeys"]} == {"production_model"}
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
        _screenshot(page, screenshots, "asset-graph.png")
    for label in labels:
        assert any(re.match(rf"{label}(?!_)", text) for text in drawn), f"{label} not drawn: {drawn}"
    for group in ("agreement", "batch", "challenger", "model", "online"):
        assert group in drawn, f"group {group} not drawn: {drawn}"
    # The challenger path beside production's: its own model pointer, replay and shadow, one report.
    assert {_key(key) for key in nodes["challenger_model"]["dependedByKeys"]} >= {
        "challenger_predictions",
        "shadow_predictions",
        "challenger_report",
    }
    assert {"predictions", "challenger_predictions", "shadow_predictions"} <= {
        _key(key) for key in nodes["challenger_report"]["dependencyKeys"]
    }
    assert nodes["challenger_predictions"]["isPartitioned"] and not nodes["shadow_predictions"]["isExecutable"]
