"""Sensors: each change requests exactly the affected partitions, once, with keys that carry the
model version and the change's watermark; what happens outside Dagster is observed once.

A promotion's rescore is an AutomationCondition now: tests/orchestration/test_automation.py."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterable
from datetime import UTC, date, datetime, timedelta
from pathlib import Path

import polars as pl
import pytest
import sqlalchemy as sa
from dagster import (
    AssetObservation,
    DagsterInstance,
    DagsterRun,
    DagsterRunStatus,
    DailyPartitionsDefinition,
    SensorDefinition,
    SensorResult,
    SkipReason,
    build_sensor_context,
)

from assets.model import NO_CHALLENGER
from assets.resources import DatabaseResource, ModelStoreResource
from inference.batch import ingest_day
from inference.migrate import upgrade
from inference.records import EVENT_TS_DTYPE, validate
from inference.store import (
    make_engine,
    mark_rejections_fixed,
    predictions,
    rejected_records,
    upsert_challenger_predictions,
    upsert_predictions,
    upsert_records,
    utc_now,
)
from orchestration.definitions import build_definitions
from orchestration.sensors import (
    WATERMARK_OVERLAP,
    SensorSettings,
    build_online_observer,
    build_production_model_observer,
    build_sensors,
)
from orchestration.settings import OrchestrationSettings
from tandem import modelstore
from tandem_specs.transactions.demo import DemoConfig, generate_day
from tests.orchestration.support import (
    DEMO_SEED,
    PARTITIONED,
    SETTINGS,
    batch_resources,
    predictions_config,
    run_partition,
)
from tests.reference import REFERENCE
from tests.shared import register_untrained_model

DAYS = ("2026-11-02", "2026-11-03")
ROWS = 600
SENSOR_MODEL = "risk_model_sensor_tests"
# Its own name: the challenger slot it moves is no other test's.
CHALLENGER_SENSOR_MODEL = "risk_model_challenger_sensor_tests"


def _run(
    url: str, assets: list, instance: DagsterInstance, keys: Iterable[str], selection: Iterable[str] = PARTITIONED
) -> None:
    resources = batch_resources(url, rows_per_day=ROWS, poison_rate=0.02, model_name=SENSOR_MODEL)
    for key in keys:
        run_partition(
            assets,
            resources,
            instance,
            partition_key=key,
            selection=selection,
            run_config=predictions_config(parity_sample=0),
        )


@pytest.fixture
def scored(database_url: str, assets: list, instance: DagsterInstance) -> str:
    """Two scored partitions under a model name of this module's own (promotions happen here)."""
    register_untrained_model(SENSOR_MODEL)
    _run(database_url, assets, instance, DAYS)
    return database_url


def _sensors() -> dict[str, SensorDefinition]:
    settings = SensorSettings(interval_seconds=5)
    partitions = DailyPartitionsDefinition(start_date=SETTINGS.partitions_start.isoformat(), timezone="UTC")
    return {
        s.name: s
        for s in [
            *build_sensors(settings, partitions=partitions),
            build_online_observer(settings),
            build_online_observer(settings, shadow=True),
            build_production_model_observer(settings),
        ]
    }


def _tick(
    sensor: SensorDefinition, url: str, cursor: str | None = None, instance: DagsterInstance | None = None
) -> SensorResult | SkipReason:
    resources = {"database": DatabaseResource(url=url), "model_store": ModelStoreResource(model_name=SENSOR_MODEL)}
    with build_sensor_context(resources=resources, cursor=cursor, instance=instance) as context:
        result = sensor(context)
    assert isinstance(result, SensorResult | SkipReason)
    return result


def _correct_records(url: str, day: str, count: int) -> None:
    frame = generate_day(date.fromisoformat(day), DemoConfig(seed=DEMO_SEED, rows_per_day=ROWS, poison_rate=0.02))
    clean = frame.filter(pl.col("poison_kind").is_null()).head(count)
    engine = make_engine(url)
    with engine.begin() as conn:
        upsert_records(
            REFERENCE,
            conn,
            validate(REFERENCE, clean.with_columns(amount=pl.col("amount") + 1.0)),
            date.fromisoformat(day),
        )
    engine.dispose()


def test_late_records_leave_a_day_with_a_run_in_flight_for_after_it(scored: str, instance: DagsterInstance) -> None:
    """The day's own daily_scoring run (a fixed-rejects re-ingest) committed its records and scores
    them next: a rescore requested beside it scores the day twice. Still stale once the run is
    over (it failed here), the day is rerun then, from a cursor that did not move past it."""
    sensor = _sensors()["late_records_sensor"]
    _correct_records(scored, DAYS[0], 3)  # history flows forward: this day's change is the older
    _correct_records(scored, DAYS[1], 3)
    run = DagsterRun(
        job_name="daily_scoring",
        run_id=str(uuid.uuid4()),
        status=DagsterRunStatus.STARTED,
        tags={"dagster/partition": DAYS[0], "tandem/trigger": "fixed_rejects"},
    )
    instance.add_run(run)

    during = _tick(sensor, scored, instance=instance)
    assert isinstance(during, SensorResult)
    assert [r.partition_key for r in during.run_requests] == [DAYS[1]]

    instance.report_run_failed(run)
    after = _tick(sensor, scored, during.cursor, instance=instance)
    assert isinstance(after, SensorResult)
    assert sorted(r.partition_key for r in after.run_requests) == list(DAYS)
    (held,) = (r for r in after.run_requests if r.partition_key == DAYS[0])
    assert json.loads(during.cursor or "{}")["watermark"] <= held.run_key.split(":", 3)[3]


def _fix_one_rejection(url: str, day: str) -> int:
    engine = make_engine(url)
    with engine.begin() as conn:
        rejection_id = (
            conn.execute(rejected_records.select().where(rejected_records.c.partition_key == day).limit(1))
            .mappings()
            .one()["rejection_id"]
        )
        assert mark_rejections_fixed(conn, [rejection_id]) == 1
    engine.dispose()
    return int(rejection_id)


def test_late_records_rerun_exactly_the_changed_partitions_once(
    scored: str, assets: list, instance: DagsterInstance
) -> None:
    sensor = _sensors()["late_records_sensor"]
    quiet = _tick(sensor, scored, instance=instance)
    assert isinstance(quiet, SensorResult)
    assert not quiet.run_requests

    for day in DAYS:  # several partitions changing within one interval are all seen
        _correct_records(scored, day, 3)
    first = _tick(sensor, scored, instance=instance)
    assert isinstance(first, SensorResult)
    assert sorted(r.partition_key for r in first.run_requests) == list(DAYS)
    for request in first.run_requests:
        assert request.run_key.startswith(f"late:{request.partition_key}:{SENSOR_MODEL}:")
    # The next tick looks back past its watermark but asks with the same keys: Dagster runs each once.
    again = _tick(sensor, scored, first.cursor, instance=instance)
    assert isinstance(again, SensorResult)
    assert {r.run_key for r in again.run_requests} == {r.run_key for r in first.run_requests}
    assert _watermark_of(again) >= _watermark_of(first)

    _run(scored, assets, instance, DAYS[:1], selection=["predictions"])
    after = _tick(sensor, scored, first.cursor, instance=instance)
    assert isinstance(after, SensorResult)
    assert [r.partition_key for r in after.run_requests] == [DAYS[1]]


def test_rejections_marked_fixed_rerun_their_partition(scored: str, assets: list, instance: DagsterInstance) -> None:
    sensor = _sensors()["fixed_rejects_sensor"]
    assert isinstance(_tick(sensor, scored), SkipReason)
    rejection_id = _fix_one_rejection(scored, DAYS[1])
    result = _tick(sensor, scored)
    assert isinstance(result, SensorResult)
    assert [r.partition_key for r in result.run_requests] == [DAYS[1]]
    assert result.run_requests[0].run_key.startswith(f"fixed:{DAYS[1]}:")
    assert isinstance(_tick(sensor, scored, result.cursor), SensorResult)  # same key again: a no-op for Dagster

    # The demo source still sends the record: the rerun refuses it again and it is open again, with
    # nothing marked fixed left to rerun (not a rerun of the partition at every tick).
    _run(scored, assets, instance, DAYS[1:])
    engine = make_engine(scored)
    with engine.connect() as conn:
        reopened = conn.execute(
            sa.select(rejected_records.c.resolved, rejected_records.c.resolution).where(
                rejected_records.c.rejection_id == rejection_id
            )
        ).one()
    engine.dispose()
    assert tuple(reopened) == (False, None)
    assert isinstance(_tick(sensor, scored, result.cursor), SkipReason)


@pytest.mark.parametrize("name", ["late_records_sensor", "fixed_rejects_sensor"])
def test_a_changed_day_outside_the_partitions_does_not_hold_back_the_others(
    scored: str, instance: DagsterInstance, name: str
) -> None:
    """The partitions start moved forward past a scored day (or the demo wrote today's rows): a
    request for that day fails the daemon's whole tick, on every tick, and the valid day changed
    beside it is never rerun. Evaluated as the daemon does, so the request is resolved against
    the jobs' partitions."""
    moved = build_definitions(OrchestrationSettings(partitions_start=DAYS[1], history_length=16))
    sensor = moved.get_repository_def().get_sensor_def(name)
    for day in DAYS:
        _correct_records(scored, day, 3)
        _fix_one_rejection(scored, day)
    resources = {"database": DatabaseResource(url=scored), "model_store": ModelStoreResource(model_name=SENSOR_MODEL)}
    cursor = None
    for _ in range(2):  # and the tick after it, from the cursor it left
        with build_sensor_context(resources=resources, cursor=cursor, definitions=moved, instance=instance) as context:
            tick = sensor.evaluate_tick(context)
        assert [r.partition_key for r in tick.run_requests or []] == [DAYS[1]]
        assert tick.cursor is not None
        cursor = tick.cursor


def test_a_moved_production_pointer_is_observed_once_as_a_new_data_version(tmp_path: Path) -> None:
    """`tandem models promote` moves the pointer outside any run: the observer reports it, once."""
    url = f"sqlite:///{tmp_path / 'unused.db'}"
    sensor = _sensors()["production_model_observer"]
    first_tag = register_untrained_model(SENSOR_MODEL)
    with DagsterInstance.ephemeral() as instance:

        def tick() -> SensorResult | SkipReason:
            result = _tick(sensor, url, instance=instance)
            for event in result.asset_events if isinstance(result, SensorResult) else []:
                instance.report_runless_asset_event(event)  # as the daemon records a sensor's events
            return result

        first = tick()
        assert isinstance(first, SensorResult)
        (observation,) = first.asset_events
        assert isinstance(observation, AssetObservation)
        assert observation.asset_key.path == ["production_model"]
        assert observation.data_version == first_tag
        assert isinstance(tick(), SkipReason), "an unchanged pointer is not observed again"

        promoted = register_untrained_model(SENSOR_MODEL, seed=1)
        after = tick()
        assert isinstance(after, SensorResult)
        assert [event.data_version for event in after.asset_events] == [promoted]
        assert isinstance(tick(), SkipReason)


@pytest.mark.parametrize("shadow", [False, True], ids=["online", "shadow"])
def test_online_results_are_observed_as_online_predictions(scored: str, shadow: bool) -> None:
    """The champion's online answers as online_predictions, the challenger's shadows beside them
    as shadow_predictions; neither observer sees the other's rows."""
    name = "shadow" if shadow else "online"
    sensor, other = (_sensors()[f"{kind}_predictions_observer"] for kind in (name, "online" if shadow else "shadow"))
    assert isinstance(_tick(sensor, scored), SkipReason)
    row = {
        "record_id": "online-1",
        "model_version": "v-online",
        "score": 0.25,
        "path": name,
        "run_id": None,
        "partition_key": None,
        "request_id": "req-1",
        "batch_id": "batch-1",
        "code_version": "test",
        "input_hash": "h",
        "history_hash": "0" * 16,
        "idempotency_key": "online-1:v-online",
        "produced_at": utc_now() - WATERMARK_OVERLAP,  # reported once its writer had time to commit it
        "latency_ms": 12.5,
    }
    engine = make_engine(scored)
    with engine.begin() as conn:
        frame = pl.DataFrame([row], schema_overrides={"produced_at": EVENT_TS_DTYPE})
        (upsert_challenger_predictions if shadow else upsert_predictions)(conn, frame)
    engine.dispose()
    assert isinstance(_tick(other, scored), SkipReason)
    result = _tick(sensor, scored)
    assert isinstance(result, SensorResult)
    (observation,) = result.asset_events
    assert isinstance(observation, AssetObservation)
    assert observation.asset_key.path == [f"{name}_predictions"]
    assert observation.metadata["rows"].value == 1
    assert observation.metadata["model_versions"].value == {"v-online": 1}
    assert isinstance(_tick(sensor, scored, result.cursor), SkipReason)


def _online_row(transaction_id: str, produced_at: datetime) -> dict[str, object]:
    return {
        "record_id": transaction_id,
        "model_version": "v-online",
        "score": 0.25,
        "path": "online",
        "run_id": None,
        "partition_key": None,
        "request_id": f"req-{transaction_id}",
        "batch_id": "batch-1",
        "code_version": "test",
        "input_hash": f"h-{transaction_id}",
        "history_hash": "0" * 16,
        "idempotency_key": None,
        "produced_at": produced_at,
        "latency_ms": 3.0,
    }


def test_an_online_result_committed_after_a_later_one_is_observed_once(tmp_path: Path) -> None:
    """The service stamps produced_at when it scores; the writer (or the outbox, after an outage)
    commits later. A row committed after a tick that saw a later-stamped one must still count."""
    url = f"sqlite:///{tmp_path / 'online.db'}"
    engine = make_engine(url)
    upgrade(engine, REFERENCE)
    now = datetime(2026, 11, 3, 12, tzinfo=UTC)
    clock = [now]
    sensor = build_online_observer(SensorSettings(interval_seconds=5), clock=lambda: clock[0])

    def write(transaction_id: str, produced_at: datetime) -> None:
        frame = pl.DataFrame(
            [_online_row(transaction_id, produced_at)], schema_overrides={"produced_at": EVENT_TS_DTYPE}
        )
        with engine.begin() as conn:
            upsert_predictions(conn, frame)

    observed: list[int] = []
    cursor = None

    def tick() -> None:
        nonlocal cursor
        result = _tick(sensor, url, cursor)
        if isinstance(result, SensorResult):
            (observation,) = result.asset_events
            assert isinstance(observation, AssetObservation)
            observed.append(int(observation.metadata["rows"].value))  # type: ignore[arg-type]
            cursor = result.cursor

    write("scored-later", now)  # committed first
    tick()
    clock[0] = now + timedelta(seconds=30)
    write("scored-first", now - timedelta(seconds=5))  # its write was behind the other's
    tick()
    for minutes in (11, 12, 30):
        clock[0] = now + timedelta(minutes=minutes)
        tick()
    assert sum(observed) == 2
    engine.dispose()


def _history_of_day_two() -> tuple[pl.DataFrame, pl.DataFrame]:
    """The last clean day-1 record of an account that comes back on day 2 (so day 2 reads it as
    history), and day 2's clean records."""
    first_day, second_day = (
        generate_day(date.fromisoformat(day), DemoConfig(seed=DEMO_SEED, rows_per_day=ROWS, poison_rate=0.02))
        .filter(pl.col("poison_kind").is_null())
        .sort("event_time")
        for day in DAYS
    )
    returning = first_day.filter(pl.col("account_id").is_in(second_day["account_id"].implode()))
    return returning.group_by("account_id").last().head(1), second_day


def test_a_correction_also_reruns_the_partitions_whose_history_it_is(
    scored: str, assets: list, instance: DagsterInstance
) -> None:
    """A corrected record on day 1 is history for its account's next records on day 2: those
    scores are stale too, so both partitions are rerun, and day 2's rows are rewritten."""
    engine = make_engine(scored)
    corrected, second_day = _history_of_day_two()
    account = corrected["account_id"][0]
    with engine.begin() as conn:
        upsert_records(
            REFERENCE,
            conn,
            validate(REFERENCE, corrected.with_columns(amount=pl.col("amount") * 3 + 1)),
            date.fromisoformat(DAYS[0]),
        )

    later_ids = second_day.filter(pl.col("account_id") == account)["transaction_id"].to_list()

    def day_two_rows() -> dict[str, tuple[float, str]]:
        with engine.connect() as conn:
            rows = conn.execute(
                predictions.select()
                .where(predictions.c.partition_key == DAYS[1])
                .where(predictions.c.record_id.in_(later_ids))
            ).mappings()
            return {row["record_id"]: (row["score"], row["history_hash"]) for row in rows}

    before = day_two_rows()
    assert before
    result = _tick(_sensors()["late_records_sensor"], scored, instance=instance)
    assert isinstance(result, SensorResult)
    assert sorted(r.partition_key for r in result.run_requests) == list(DAYS)

    _run(scored, assets, instance, DAYS, selection=["predictions"])
    after = day_two_rows()
    # The account's first day-2 record reads the corrected one as its latest history.
    next_record = second_day.filter(pl.col("account_id") == account)["transaction_id"][0]
    assert after.keys() == before.keys()
    assert after[next_record][1] != before[next_record][1]
    assert after[next_record][0] != before[next_record][0]
    engine.dispose()


def _watermark_of(result: SensorResult) -> datetime:
    return datetime.fromisoformat(json.loads(result.cursor or "{}")["watermark"])


def test_a_correction_scored_in_the_run_that_ingested_it_reruns_the_later_days_it_is_history_of(
    scored: str, assets: list, instance: DagsterInstance
) -> None:
    """A daily_scoring re-ingest (as fixed_rejects_sensor launches it) stores the corrected day-1
    record and scores day 1 at once: its own contents have a batch answer, but day 2, scored
    before, read the old one as history. Day 2 alone is rerun; once rerun, nothing is."""
    sensor = _sensors()["late_records_sensor"]
    quiet = _tick(sensor, scored, instance=instance)
    assert isinstance(quiet, SensorResult)
    assert not quiet.run_requests
    history, _ = _history_of_day_two()
    engine = make_engine(scored)
    with engine.begin() as conn:
        upsert_records(
            REFERENCE,
            conn,
            validate(REFERENCE, history.with_columns(amount=pl.col("amount") * 3)),
            date.fromisoformat(DAYS[0]),
        )
    engine.dispose()
    _run(scored, assets, instance, DAYS[:1], selection=["predictions"])

    after_ingest = _tick(sensor, scored, quiet.cursor, instance=instance)
    assert isinstance(after_ingest, SensorResult)
    assert [r.partition_key for r in after_ingest.run_requests] == [DAYS[1]]

    _run(scored, assets, instance, DAYS[1:], selection=["predictions"])
    rerun = _tick(sensor, scored, after_ingest.cursor, instance=instance)
    assert isinstance(rerun, SensorResult)
    assert not rerun.run_requests
    # A tick that found nothing still moves on, so what it judged is not read again for ever.
    assert _watermark_of(rerun) > _watermark_of(after_ingest)


def test_a_record_a_re_sent_day_no_longer_holds_reruns_its_day_and_the_days_it_is_history_of(
    scored: str, instance: DagsterInstance
) -> None:
    """The corrected file of day 1 lacks a record an account's day-2 records read as history: it
    leaves the store, and both days are rerun (day 2's features no longer read it)."""
    sensor = _sensors()["late_records_sensor"]
    quiet = _tick(sensor, scored, instance=instance)
    assert isinstance(quiet, SensorResult)
    history, _ = _history_of_day_two()
    first_day = generate_day(
        date.fromisoformat(DAYS[0]), DemoConfig(seed=DEMO_SEED, rows_per_day=ROWS, poison_rate=0.02)
    )
    dropped = history["transaction_id"][0]
    engine = make_engine(scored)
    report = ingest_day(
        REFERENCE, engine, first_day.filter(pl.col("transaction_id") != dropped), date.fromisoformat(DAYS[0])
    )
    engine.dispose()
    assert report.rows_withdrawn == 1

    result = _tick(sensor, scored, quiet.cursor, instance=instance)
    assert isinstance(result, SensorResult)
    assert sorted(r.partition_key for r in result.run_requests) == list(DAYS)


def test_the_observer_reports_the_challenger_slot_when_it_moves(tmp_path: Path) -> None:
    sensor = build_production_model_observer(SensorSettings())
    champion = register_untrained_model(CHALLENGER_SENSOR_MODEL)
    with DagsterInstance.ephemeral() as instance:

        def tick() -> list[tuple[str, str | None]]:
            with build_sensor_context(
                instance=instance, resources={"model_store": ModelStoreResource(model_name=CHALLENGER_SENSOR_MODEL)}
            ) as context:
                result = sensor(context)
            if isinstance(result, SkipReason):
                return []
            assert isinstance(result, SensorResult)
            events = []
            for event in result.asset_events:
                assert isinstance(event, AssetObservation)
                instance.report_runless_asset_event(event)  # as the daemon records a sensor's events
                events.append((event.asset_key.to_user_string(), event.data_version))
            return events

        assert tick() == [("production_model", champion)], "an empty slot never observed is not news"
        assert tick() == []

        challenger = modelstore.challenge(register_untrained_model(CHALLENGER_SENSOR_MODEL, seed=1, promote=False))
        assert tick() == [("challenger_model", challenger)]
        assert tick() == [], "an unchanged slot is observed once"

        modelstore.clear_challenger(CHALLENGER_SENSOR_MODEL)
        assert tick() == [("challenger_model", NO_CHALLENGER)]
        assert tick() == []

        modelstore.challenge(challenger)
        assert tick() == [("challenger_model", challenger)]
        modelstore.promote(challenger)  # a promoted challenger leaves the slot: both move at once
        assert tick() == [("production_model", challenger), ("challenger_model", NO_CHALLENGER)]
        assert tick() == []
