"""A user's own files through Dagster: `transactions` ingests them, a broken day fails alone, and
the landing sensor requests each new or changed day once."""

from __future__ import annotations

import csv
import os
import shutil
import uuid
from datetime import date
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from dagster import (
    AssetMaterialization,
    DagsterEventType,
    DagsterInstance,
    DagsterRun,
    DagsterRunStatus,
    SensorDefinition,
    SensorResult,
    SkipReason,
    build_sensor_context,
)
from pydantic import ValidationError

from assets.resources import DatabaseResource, ModelStoreResource, RecordSourceResource
from assets.scoring import records_key
from inference.sources import FileSource
from inference.store import make_engine, rejected_records
from orchestration.definitions import build_definitions
from orchestration.sensors import DAILY_JOB, ingest_job_name
from tests.orchestration.support import (
    MODEL_NAME,
    PARTITION,
    SETTINGS,
    demo_source,
    predictions_config,
    run_partition,
)
from tests.reference import RAW_COLUMNS, RECORDS, REFERENCE

INGEST_JOB = ingest_job_name(records_key(REFERENCE))

FOLDER_PATTERN = "{date:%Y-%m-%d}/"
CATEGORIES = ("grocery", "restaurant", "fuel", "pharmacy", "travel")


def _user_rows(day: str, count: int) -> list[dict[str, Any]]:
    """What a user's export looks like: their own ids, a few accounts, ISO times with offsets."""
    return [
        {
            "transaction_id": f"shop-{day}-{i:04d}",
            "account_id": f"customer-{i % 7}",
            "amount": f"{10 + i * 1.25:.2f}",
            "currency": "EUR",
            "merchant_category": CATEGORIES[i % len(CATEGORIES)],
            "country": "DE",
            "event_time": f"{day}T{i % 24:02d}:{i % 60:02d}:00+01:00",
            "channel": "web",  # a column Tandem does not use
        }
        for i in range(count)
    ]


def _write_csv(path: Path, rows: list[dict[str, Any]], columns: list[str] | None = None) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    names = columns or list(rows[0])
    with path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=names, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)


def _resources(url: str, landing: Path, pattern: str = FOLDER_PATTERN) -> dict[str, Any]:
    return {
        "database": DatabaseResource(url=url),
        "model_store": ModelStoreResource(model_name=MODEL_NAME),
        "source": RecordSourceResource(kind="files", location=str(landing), pattern=pattern),
    }


def _stored(url: str, table: sa.Table, column: sa.Column[Any], value: object) -> list[dict[str, Any]]:
    engine = make_engine(url)
    try:
        with engine.connect() as conn:
            return [dict(row._mapping) for row in conn.execute(table.select().where(column == value))]
    finally:
        engine.dispose()


def test_a_folder_of_a_users_csv_files_is_ingested_and_scored(
    assets: list, production_tag: str, instance: DagsterInstance, database_url: str, tmp_path: Path
) -> None:
    rows = _user_rows(PARTITION, 120)
    rows[5]["amount"] = "12,50"  # a decimal comma: this row is quarantined, the day is not
    rows[9]["transaction_id"] = ""  # no id: cannot even be stored
    _write_csv(tmp_path / PARTITION / "export-1.csv", rows[:60])
    _write_csv(tmp_path / PARTITION / "export-2.csv", rows[60:])

    result = run_partition(
        assets, _resources(database_url, tmp_path), instance, run_config=predictions_config(parity_sample=4)
    )

    assert result.success
    (ingested,) = result.asset_materializations_for_node("transactions")
    metadata = {key: value.value for key, value in ingested.metadata.items()}
    assert metadata["source_kind"] == "files"
    assert metadata["source_paths"] == [str(tmp_path / PARTITION / f"export-{n}.csv") for n in (1, 2)]
    source = FileSource(REFERENCE, str(tmp_path), FOLDER_PATTERN)
    assert metadata["source_version"] == source.versions()[date.fromisoformat(PARTITION)]
    # The decimal comma is no number: quarantined at ingest with its text, as the row without an id.
    assert (metadata["rows_received"], metadata["rows_stored"], metadata["rejected_at_ingest"]) == (120, 118, 2)
    assert "rows_labelled" not in metadata, "the user's files have no label column"
    stored = _stored(database_url, RECORDS, RECORDS.c.partition_date, date.fromisoformat(PARTITION))
    assert len(stored) == 118
    assert {row["channel"] for row in rows} == {"web"} and "channel" not in stored[0]
    (scored,) = result.asset_materializations_for_node("predictions")
    assert scored.metadata["scored"].value == 118
    reasons = {
        (r["record_id"], r["reason"])
        for r in _stored(database_url, rejected_records, rejected_records.c.partition_key, PARTITION)
    }
    assert reasons == {(None, "missing_field"), (rows[5]["transaction_id"], "amount_unparsable")}


def test_a_day_of_decimal_comma_amounts_blocks_on_its_reject_rate(
    assets: list, production_tag: str, instance: DagsterInstance, sqlite_url: str, tmp_path: Path
) -> None:
    """Every amount `12,50`: every row refused at ingest, none stored. The reject rate counts them,
    so the day blocks instead of passing as 0 rejected of 0 stored."""
    rows = [{**row, "amount": row["amount"].replace(".", ",")} for row in _user_rows(PARTITION, 20)]
    _write_csv(tmp_path / PARTITION / "export-1.csv", rows)

    result = run_partition(
        assets,
        _resources(sqlite_url, tmp_path),
        instance,
        run_config=predictions_config(parity_sample=0),
        raise_on_error=False,
    )

    assert not result.success  # the blocking check failed
    checks = {evaluation.check_name: evaluation for evaluation in result.get_asset_check_evaluations()}
    rate = checks["reject_rate_bounded"]
    assert not rate.passed and rate.severity.value == "ERROR"
    metadata = {key: value.value for key, value in rate.metadata.items()}
    assert (metadata["reject_rate"], metadata["rejected_at_ingest"], metadata["rejected_at_scoring"]) == (1.0, 20, 0)
    # Each refused row names the run that refused it (`tandem lineage` links it).
    runs = {r["run_id"] for r in _stored(sqlite_url, rejected_records, rejected_records.c.partition_key, PARTITION)}
    assert runs == {result.run_id}


def test_a_broken_day_file_fails_that_partition_alone_with_its_reason(
    assets: list, instance: DagsterInstance, sqlite_url: str, tmp_path: Path
) -> None:
    good, broken = "2026-11-02", PARTITION
    _write_csv(tmp_path / f"{good}.csv", _user_rows(good, 10))
    _write_csv(
        tmp_path / f"{broken}.csv", _user_rows(broken, 10), columns=[c for c in RAW_COLUMNS if c != "event_time"]
    )
    resources = _resources(sqlite_url, tmp_path, pattern="{date:%Y-%m-%d}.csv")
    results = {
        key: run_partition(
            assets, resources, instance, partition_key=key, selection=["transactions"], raise_on_error=False
        )
        for key in (good, broken, "2026-11-04")
    }

    assert results[good].success
    failed = results[broken]
    assert not failed.success
    (failure,) = failed.get_step_failure_events()
    message = failure.step_failure_data.user_failure_data.description  # type: ignore[union-attr]
    assert (
        message == f"{tmp_path / (broken + '.csv')}: column 'event_time': missing (required: {', '.join(RAW_COLUMNS)})"
    )
    # Not retried: the same file would fail the same way.
    retried = [e for e in failed.all_events if e.event_type == DagsterEventType.STEP_UP_FOR_RETRY]
    assert retried == []
    missing = results["2026-11-04"]
    assert not missing.success
    (failure,) = missing.get_step_failure_events()
    assert failure.step_failure_data.user_failure_data.description == (  # type: ignore[union-attr]
        f"no file for 2026-11-04 at {tmp_path / '2026-11-04.csv'}"
    )
    assert len(_stored(sqlite_url, RECORDS, RECORDS.c.partition_date, date(2026, 11, 2))) == 10


def test_the_demo_goes_through_the_landing_folder(assets: list, instance: DagsterInstance, sqlite_url: str) -> None:
    resources = _resources(sqlite_url, Path("unused")) | {"source": demo_source(rows_per_day=300, poison_rate=0.02)}
    result = run_partition(assets, resources, instance, selection=["transactions"])
    (ingested,) = result.asset_materializations_for_node("transactions")
    (path,) = ingested.metadata["source_paths"].value  # type: ignore[misc]
    assert ingested.metadata["source_kind"].value == "demo"
    assert Path(str(path)).name == f"{PARTITION}.csv" and Path(str(path)).is_file()
    assert ingested.metadata["rows_received"].value == 300


@pytest.mark.parametrize(("field", "value"), [("rows_per_day", 0), ("poison_rate", 1.5), ("poison_rate", -0.5)])
def test_the_demo_source_is_bounded_as_its_settings_are(
    field: str, value: float, assets: list, instance: DagsterInstance, sqlite_url: str, tmp_path: Path
) -> None:
    # Unbounded, 0 rows a day and a poison rate of 1.5 ran and succeeded; TANDEM_DEMO_* refuse them.
    with pytest.raises(ValidationError, match=field):
        RecordSourceResource(kind="demo", location=str(tmp_path), **{field: value})
    RecordSourceResource(kind="demo", location=str(tmp_path), rows_per_day=1, poison_rate=1.0)

    # Given as run config, the run fails before the step reads a day.
    resources = _resources(sqlite_url, tmp_path) | {"source": RecordSourceResource.configure_at_launch()}
    config = {"kind": "demo", "location": str(tmp_path), field: value}
    result = run_partition(
        assets,
        resources,
        instance,
        selection=["transactions"],
        run_config={"resources": {"source": {"config": config}}},
        raise_on_error=False,
    )
    assert not result.success
    assert not result.asset_materializations_for_node("transactions")
    assert not list(tmp_path.glob("*.csv"))


# The landing sensor ---------------------------------------------------------------------------


def _landing_sensor() -> SensorDefinition:
    return {sensor.name: sensor for sensor in build_definitions(SETTINGS).sensors or []}["landing_sensor"]


def _tick(
    instance: DagsterInstance, landing: Path, cursor: str | None = None, kind: str = "files"
) -> SensorResult | SkipReason:
    source = RecordSourceResource(kind=kind, location=str(landing), pattern="{date:%Y-%m-%d}.csv")
    with build_sensor_context(instance=instance, resources={"source": source}, cursor=cursor) as context:
        result = _landing_sensor()(context)
    assert isinstance(result, SensorResult | SkipReason)
    return result


def _version(landing: Path, day: str) -> str:
    return FileSource(REFERENCE, str(landing)).versions()[date.fromisoformat(day)]


def _rewrite(path: Path, rows: list[dict[str, Any]]) -> None:
    mtime = path.stat().st_mtime_ns
    _write_csv(path, rows)
    os.utime(path, ns=(mtime + 1_000_000_000, mtime + 1_000_000_000))  # a later mtime, whatever the clock


def test_a_new_day_file_requests_daily_scoring_once(instance: DagsterInstance, tmp_path: Path) -> None:
    assert isinstance(_tick(instance, tmp_path / "not-yet"), SkipReason)
    _write_csv(tmp_path / f"{PARTITION}.csv", _user_rows(PARTITION, 5))
    version = _version(tmp_path, PARTITION)

    first = _tick(instance, tmp_path)

    assert isinstance(first, SensorResult)
    (request,) = first.run_requests
    assert (request.job_name, request.partition_key, request.run_key) == (
        DAILY_JOB,
        PARTITION,
        f"landing:{PARTITION}:none->{version}",
    )
    again = _tick(instance, tmp_path, first.cursor)
    assert isinstance(again, SkipReason)
    # Even without the cursor (a reset sensor), the run key is the same: Dagster runs it once.
    replay = _tick(instance, tmp_path)
    assert isinstance(replay, SensorResult)
    assert [r.run_key for r in replay.run_requests] == [request.run_key]


def test_a_changed_file_of_a_scored_day_requests_a_reingest(instance: DagsterInstance, tmp_path: Path) -> None:
    path = tmp_path / f"{PARTITION}.csv"
    _write_csv(path, _user_rows(PARTITION, 5))
    first = _tick(instance, tmp_path)
    assert isinstance(first, SensorResult)
    instance.report_runless_asset_event(AssetMaterialization("predictions", partition=PARTITION))

    rows = _user_rows(PARTITION, 5)
    rows[2]["amount"] = "99.00"  # a correction
    _rewrite(path, rows)
    changed = _tick(instance, tmp_path, first.cursor)

    assert isinstance(changed, SensorResult)
    (request,) = changed.run_requests
    new_version = _version(tmp_path, PARTITION)
    assert new_version != first.run_requests[0].run_key.rsplit("->", 1)[1]
    assert (request.job_name, request.partition_key, request.run_key) == (
        INGEST_JOB,
        PARTITION,
        f"landing:{PARTITION}:none->{new_version}",
    )
    assert isinstance(_tick(instance, tmp_path, changed.cursor), SkipReason)


def test_a_file_restored_to_a_version_ingested_before_is_ingested_again(
    instance: DagsterInstance, tmp_path: Path
) -> None:
    """A correction was wrong and upstream re-delivers its first file (`cp -p`, `rsync -a`, an
    object store restore): same name, size and mtime, so the version ingested first. Its request
    must not repeat a run key Dagster has seen, or the daemon drops it and the day keeps the
    correction's content; a tick repeated for this same change must still ask the same key."""
    path = tmp_path / f"{PARTITION}.csv"
    _write_csv(path, _user_rows(PARTITION, 5))
    original = tmp_path / "original.csv.keep"
    shutil.copy2(path, original)
    keys: list[str] = []
    versions: list[str] = []
    cursor = None

    def ingest(version: str) -> None:  # what the requested run's transactions step records
        instance.report_runless_asset_event(
            AssetMaterialization("transactions", partition=PARTITION, metadata={"source_version": version})
        )

    for change in ("first", "corrected", "restored", "corrected again"):
        if change in ("corrected", "corrected again"):
            rows = _user_rows(PARTITION, 5)
            rows[2]["amount"] = "99.00"
            _rewrite(path, rows)
            os.utime(path, ns=(os.stat(original).st_mtime_ns + 10**9,) * 2)  # the same corrected version each time
        elif change == "restored":
            shutil.copy2(original, path)
        result = _tick(instance, tmp_path, cursor)
        assert isinstance(result, SensorResult), change
        (request,) = result.run_requests
        assert request.run_key not in keys, change
        repeated = _tick(instance, tmp_path, cursor)  # the daemon lost this tick's cursor
        assert isinstance(repeated, SensorResult)
        assert [r.run_key for r in repeated.run_requests] == [request.run_key]
        keys.append(request.run_key)
        versions.append(_version(tmp_path, PARTITION))
        ingest(versions[-1])
        cursor = result.cursor
    assert versions[2:] == versions[:2]  # each version is delivered, and asked for, twice
    assert isinstance(_tick(instance, tmp_path, cursor), SkipReason)


def test_a_changed_file_of_a_day_never_scored_requests_ingest_and_scoring(
    instance: DagsterInstance, tmp_path: Path
) -> None:
    """E.g. the first file was broken and its run failed: the fixed file must still get scored."""
    path = tmp_path / f"{PARTITION}.csv"
    _write_csv(path, _user_rows(PARTITION, 5))
    first = _tick(instance, tmp_path)
    assert isinstance(first, SensorResult)
    _rewrite(path, _user_rows(PARTITION, 6))
    changed = _tick(instance, tmp_path, first.cursor)
    assert isinstance(changed, SensorResult)
    assert [r.job_name for r in changed.run_requests] == [DAILY_JOB]


def test_a_day_already_ingested_from_this_file_requests_nothing(
    assets: list, instance: DagsterInstance, sqlite_url: str, tmp_path: Path
) -> None:
    """The demo writes its file inside the ingest; a run started by hand read it too."""
    demo = RecordSourceResource(kind="demo", location=str(tmp_path), rows_per_day=200, poison_rate=0.0)
    resources = _resources(sqlite_url, tmp_path) | {"source": demo}
    assert run_partition(assets, resources, instance, selection=["transactions"]).success

    result = _tick(instance, tmp_path, kind="demo")

    assert isinstance(result, SensorResult)
    assert result.run_requests == []
    assert result.cursor is not None and PARTITION in result.cursor  # remembered, not looked up again


# How each launcher names a run's day: a sensor, a job backfill or the launchpad in
# dagster/partition; an asset backfill (docs/batch.md's) as a range, even of one day.
RUN_TAGS_NAMING_THE_DAY = {
    "sensor_or_launchpad": {"dagster/partition": PARTITION},
    "asset_backfill_of_one_day": {
        "dagster/asset_partition_range_start": PARTITION,
        "dagster/asset_partition_range_end": PARTITION,
    },
    "asset_backfill_of_a_range": {
        "dagster/asset_partition_range_start": "2026-11-01",
        "dagster/asset_partition_range_end": "2026-11-05",
    },
}


@pytest.mark.parametrize("tags", RUN_TAGS_NAMING_THE_DAY.values(), ids=RUN_TAGS_NAMING_THE_DAY.keys())
def test_a_day_with_a_run_in_flight_is_left_for_a_later_tick(
    instance: DagsterInstance, tmp_path: Path, tags: dict[str, str]
) -> None:
    """The run may be writing this very file (the demo): requesting another run of the day would
    ingest and score it twice."""
    _write_csv(tmp_path / f"{PARTITION}.csv", _user_rows(PARTITION, 5))
    run_id = str(uuid.uuid4())
    instance.add_run(DagsterRun(job_name="__ASSET_JOB", run_id=run_id, status=DagsterRunStatus.STARTED, tags=tags))
    assert isinstance(_tick(instance, tmp_path), SkipReason)

    instance.report_run_failed(instance.get_run_by_id(run_id))  # over (and read nothing): now it is new
    result = _tick(instance, tmp_path)
    assert isinstance(result, SensorResult)
    assert [request.partition_key for request in result.run_requests] == [PARTITION]


def test_a_run_of_other_days_in_flight_does_not_hold_this_one_back(instance: DagsterInstance, tmp_path: Path) -> None:
    _write_csv(tmp_path / f"{PARTITION}.csv", _user_rows(PARTITION, 5))
    instance.add_run(
        DagsterRun(
            job_name="__ASSET_JOB",
            run_id=str(uuid.uuid4()),
            status=DagsterRunStatus.STARTED,
            tags={
                "dagster/asset_partition_range_start": "2026-11-04",
                "dagster/asset_partition_range_end": "2026-11-06",
            },
        )
    )
    result = _tick(instance, tmp_path)
    assert isinstance(result, SensorResult)
    assert [request.partition_key for request in result.run_requests] == [PARTITION]


def test_days_outside_the_partitions_are_skipped(instance: DagsterInstance, tmp_path: Path) -> None:
    for day in ("2026-10-31", "2999-01-01"):  # before TANDEM_PARTITIONS_START; not over yet
        _write_csv(tmp_path / f"{day}.csv", _user_rows(day, 3))
    assert isinstance(_tick(instance, tmp_path), SkipReason)
    _write_csv(tmp_path / f"{PARTITION}.csv", _user_rows(PARTITION, 3))
    result = _tick(instance, tmp_path)
    assert isinstance(result, SensorResult)
    assert [r.partition_key for r in result.run_requests] == [PARTITION]


def test_a_tick_that_finds_nothing_new_logs_nothing_at_info(
    instance: DagsterInstance, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    # A day not over yet logged "is not a partition (yet); skipped" at INFO on every tick until
    # midnight, into the daemon's output. (A sensor's context.log writes to the console, not to
    # Python's logging tree, so the test reads the process's output.)
    _write_csv(tmp_path / "2999-01-01.csv", _user_rows("2999-01-01", 3))
    _write_csv(tmp_path / f"{PARTITION}.csv", _user_rows(PARTITION, 3))
    first = _tick(instance, tmp_path)
    assert isinstance(first, SensorResult)
    capfd.readouterr()

    idle = [_tick(instance, tmp_path, first.cursor) for _ in range(3)]

    printed = capfd.readouterr()
    assert [line for line in (printed.out + printed.err).splitlines() if " - INFO - " in line] == []
    assert all(isinstance(result, SkipReason) for result in idle)
    assert "2999-01-01" in str(idle[0].skip_message)  # said where the UI shows the tick


def test_a_sql_source_has_no_landing_folder_to_watch(instance: DagsterInstance, tmp_path: Path) -> None:
    source = RecordSourceResource(kind="sql", url="sqlite://", query="SELECT 1")
    with build_sensor_context(instance=instance, resources={"source": source}) as context:
        assert isinstance(_landing_sensor()(context), SkipReason)
