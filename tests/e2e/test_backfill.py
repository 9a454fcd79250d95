"""Issues #6 and #15, the morning after deployment: the week is ingested, then the backfill docs/batch.md
describes (an asset backfill of `predictions` and `path_agreement` over a date range) scores every
day and quarantines the poison, never running more runs than `max_concurrent_runs` or more
`database` steps than the pool allows. Corrected source records then make the late-records sensor
rescore exactly the partitions they touch.

One deployment serves the whole package, in the order tests/e2e/conftest.py gives its modules.
"""

from __future__ import annotations

import re
from collections import Counter
from datetime import date
from pathlib import Path

import polars as pl
import pytest
import sqlalchemy as sa
import yaml
from sqlalchemy.engine import Engine

from assets.deadline import DEADLINE_CHECK
from inference.records import hash_inputs, validate
from inference.store import (
    RejectStage,
    ResultPath,
    predictions,
    read_partition_rows,
    rejected_records,
    upsert_records,
)
from orchestration.sensors import RESCORE_JOB
from orchestration.settings import OrchestrationSettings
from tandem_specs.transactions.demo import EXPECTED_REASON
from tests.e2e.deployment import (
    SENSOR_INTERVAL_SECONDS,
    Deployment,
)
from tests.e2e.graphql import (
    Repository,
    assert_nothing_requested_after,
    assets_of,
    list_runs,
    run_events,
    run_tags,
    wait_for_runs_covering,
)
from tests.e2e.week import (
    PARTITIONS,
    SCORING_ASSETS,
    BackfillOutcome,
)
from tests.reference import RAW_COLUMNS, RECORDS, REFERENCE

# The deployment and the backfill are set up inside the budget of the first test that asks for them.
pytestmark = [pytest.mark.e2e, pytest.mark.live, pytest.mark.postgres, pytest.mark.timeout(900)]

CORRECTED_PARTITIONS = ("2026-11-03", "2026-11-06")
CORRECTIONS_PER_PARTITION = 3
DATABASE_POOL = "database"


def peak_overlap(intervals: list[tuple[float, float]]) -> int:
    """The most intervals open at one moment (one that ends as another starts does not overlap it)."""
    edges = sorted([(start, 1) for start, _ in intervals] + [(end, -1) for _, end in intervals])
    open_now = peak = 0
    for _, step in edges:
        open_now += step
        peak = max(peak, open_now)
    return peak


def _correct_records(engine: Engine, partition: str, count: int) -> dict[str, str]:
    """A source correction: `count` valid records of the day get a new amount. Returns id -> new input hash."""
    day = date.fromisoformat(partition)
    with engine.begin() as conn:
        stored = validate(REFERENCE, read_partition_rows(REFERENCE, conn, day))
        chosen = stored.filter(pl.col("reject_reason").is_null()).sort("transaction_id").head(count)
        corrected = validate(REFERENCE, chosen.select(*RAW_COLUMNS, "label_fraud").with_columns(pl.col("amount") + 1.0))
        assert corrected["reject_reason"].is_null().all(), "a correction must stay a valid record"
        changed = upsert_records(REFERENCE, conn, corrected, day)
    assert changed == count, f"{partition}: {changed} of {count} corrected rows stored as changes"
    return dict(zip(corrected["transaction_id"].to_list(), hash_inputs(REFERENCE, corrected).to_list(), strict=True))


def _history_readers(engine: Engine, corrected: set[str], history_length: int) -> dict[str, str]:
    """Records whose features read a corrected record as history: the account's next
    `history_length` valid records. Returns transaction id -> partition."""
    t = RECORDS.c
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


def test_the_readme_backfill_scores_every_partition_and_quarantines_the_poison(
    deployment: Deployment, ingested: BackfillOutcome, backfill: BackfillOutcome, engine: Engine
) -> None:
    # One run per partition (BackfillPolicy.multi_run(1)), each day's two assets in the same run.
    assert len(backfill.runs) == len(PARTITIONS)
    for run in backfill.runs:
        assert run["status"] == "SUCCESS"
        assert assets_of(run) == SCORING_ASSETS
    for partition in PARTITIONS:
        assert (
            backfill.materialized_by["predictions"][partition] == backfill.materialized_by["path_agreement"][partition]
        )
    assert {run["runId"] for run in backfill.runs} == set(backfill.materialized_by["predictions"].values())
    assert all(assets_of(run) == ["transactions"] for run in ingested.runs) and len(ingested.runs) == len(PARTITIONS)

    # What the tables hold: each day fully accounted for, scored by its own run, poison quarantined.
    p, r, t = predictions.c, rejected_records.c, RECORDS.c
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
            assert set(reasons) == set(EXPECTED_REASON.values()), f"{partition}: {reasons}"


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
    deadline_checks = 0
    for run in runs:
        events = run_events(deployment, run["runId"])
        # From the moment the queue let the run go (RUN_STARTING) to its end: what the limit counts.
        launched = min(float(e["timestamp"]) / 1000 for e in events if e["__typename"] == "RunStartingEvent")
        run_spans.append((launched, run["endTime"]))
        # Every step of these runs is in the database pool (tests/orchestration/test_definitions.py)
        # but the deadline check an asset backfill runs beside predictions, which reads Dagster's own
        # event log only.
        steps = run["stepStats"]
        deadline_checks += sum(DEADLINE_CHECK in step["stepKey"] for step in steps)
        step_spans += [(step["startTime"], step["endTime"]) for step in steps if DEADLINE_CHECK not in step["stepKey"]]
    assert len(step_spans) == len(ingested.runs) + 2 * len(backfill.runs)
    assert deadline_checks == len(backfill.runs)

    assert 2 <= peak_overlap(run_spans) <= max_runs, sorted(run_spans)
    assert peak_overlap(step_spans) <= pool_limit, sorted(step_spans)

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
    assert not list_runs(deployment, tags=[{"key": "tandem/trigger", "value": "late_records"}]), (
        "runs before any change"
    )

    new_hashes = {
        partition: _correct_records(engine, partition, CORRECTIONS_PER_PARTITION) for partition in CORRECTED_PARTITIONS
    }
    corrected = {tid for hashes in new_hashes.values() for tid in hashes}
    readers = _history_readers(engine, corrected, OrchestrationSettings().history_length)
    touched = sorted(set(CORRECTED_PARTITIONS) | set(readers.values()))

    late_records = [{"key": "tandem/trigger", "value": "late_records"}]
    runs = wait_for_runs_covering(
        deployment, lambda: list_runs(deployment, tags=late_records), touched, "late-records rescoring"
    )
    assert_nothing_requested_after(deployment, repository, sensor, runs, timeout=10 * SENSOR_INTERVAL_SECONDS)

    runs = list_runs(deployment, tags=late_records)
    by_partition = {run_tags(run)["dagster/partition"]: run for run in runs}
    assert sorted(by_partition) == touched, [run_tags(run) for run in runs]
    assert len(runs) == len(touched), "one run per touched partition"
    for run in runs:
        assert run["jobName"] == RESCORE_JOB
        assert run["status"] == "SUCCESS"
        assert run_tags(run)["tandem/model_version"] == deployment.production_tag

    p = predictions.c
    with engine.connect() as conn:
        for partition in PARTITIONS:
            rows = conn.execute(
                sa.select(p.record_id, p.input_hash, p.run_id).where(
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
