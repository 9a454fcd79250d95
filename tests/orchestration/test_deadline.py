"""The batch path's deadline: a day missing at its deadline is paged once and marked failed on its
partition, even though no run of it ever started; a day scored in time raises nothing. The clock is
injected; the webhook is a real local HTTP server."""

from __future__ import annotations

from datetime import UTC, date, datetime, timedelta

import pytest
from dagster import (
    AssetCheckEvaluation,
    AssetCheckKey,
    AssetCheckSeverity,
    AssetMaterialization,
    DagsterInstance,
    DailyPartitionsDefinition,
    SensorResult,
    SkipReason,
    asset,
    build_sensor_context,
    materialize,
)
from pydantic import ValidationError

from assets.deadline import DEADLINE_CHECK, PREDICTIONS, build_deadline_check
from assets.settings import DeadlineSettings
from orchestration.deadline import build_deadline_sensor
from orchestration.definitions import defs
from orchestration.sensors import SensorSettings
from tests.e2e.deployment import WebhookReceiver

DAY = date(2026, 11, 3)
CHECK = AssetCheckKey(PREDICTIONS, DEADLINE_CHECK)


def _tick(
    instance: DagsterInstance, first_day: date, now: datetime, cursor: str | None = None
) -> SensorResult | SkipReason:
    """One evaluation at `now`, its check evaluations recorded as the daemon records them."""
    partitions = DailyPartitionsDefinition(start_date=first_day.isoformat(), timezone="UTC")
    sensor = build_deadline_sensor(SensorSettings(), partitions=partitions, clock=lambda: now)
    with build_sensor_context(instance=instance, cursor=cursor) as context:
        result = sensor(context)
    assert isinstance(result, SensorResult | SkipReason)
    if isinstance(result, SensorResult):
        for event in result.asset_events:
            instance.report_runless_asset_event(event)
    return result


def _evaluations(result: SensorResult) -> list[AssetCheckEvaluation]:
    assert all(isinstance(event, AssetCheckEvaluation) for event in result.asset_events)
    return [event for event in result.asset_events if isinstance(event, AssetCheckEvaluation)]


def test_the_default_deadline_is_eight_utc_the_next_day_and_is_read_when_used(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    settings = DeadlineSettings()
    assert settings.due(DAY) == datetime(2026, 11, 4, 8, 0, tzinfo=UTC)
    assert settings.last_due_day(datetime(2026, 11, 4, 7, 59, tzinfo=UTC)) == date(2026, 11, 2)
    assert settings.last_due_day(datetime(2026, 11, 4, 8, 0, tzinfo=UTC)) == DAY
    monkeypatch.setenv("TANDEM_PREDICTIONS_DEADLINE_UTC", "06:30")
    assert DeadlineSettings().due(DAY) == datetime(2026, 11, 4, 6, 30, tzinfo=UTC)
    monkeypatch.setenv("TANDEM_PREDICTIONS_DEADLINE_UTC", "08:00+02:00")  # a local time would move with DST
    with pytest.raises(ValidationError, match="UTC time of day"):
        DeadlineSettings()


def test_a_day_no_run_ever_started_is_paged_once_and_marked_failed_on_its_partition(
    instance: DagsterInstance, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The 02:00 run never ran: nothing of the day exists in Dagster, and the deadline still fires."""
    with WebhookReceiver() as receiver:
        monkeypatch.setenv("TANDEM_ALERT_WEBHOOK_URL", receiver.url)
        monkeypatch.setenv("TANDEM_DAGSTER_UI_URL", "http://dagster.example:3000")
        just_before = _tick(instance, DAY, datetime(2026, 11, 4, 7, 59, tzinfo=UTC))
        assert isinstance(just_before, SensorResult) and not just_before.asset_events
        assert receiver.received == []

        after = _tick(instance, DAY, datetime(2026, 11, 4, 8, 0, 30, tzinfo=UTC), just_before.cursor)
        assert isinstance(after, SensorResult)
        (body,) = receiver.received
        assert body["event"] == "predictions_deadline_missed"
        assert body["partition"] == DAY.isoformat()
        assert body["deadline"] == "2026-11-04T08:00:00+00:00"
        assert body["delivered_at"] is None and body["run_in_flight"] is False
        assert body["url"] == "http://dagster.example:3000/assets/predictions?view=partitions&partition=2026-11-03"
        (evaluation,) = _evaluations(after)
        assert (evaluation.partition, evaluation.passed, evaluation.severity) == (
            DAY.isoformat(),
            False,
            AssetCheckSeverity.ERROR,
        )

        # Every later tick of the day, and of the next day, leaves the late day alone.
        again = _tick(instance, DAY, datetime(2026, 11, 4, 8, 1, tzinfo=UTC), after.cursor)
        assert isinstance(again, SkipReason)
        next_day = _tick(instance, DAY, datetime(2026, 11, 5, 8, 1, tzinfo=UTC), after.cursor)
        assert isinstance(next_day, SensorResult)
    assert [body["partition"] for body in receiver.received] == ["2026-11-03", "2026-11-04"]

    # What the UI's partition view of the check reads: the day stands failed until it is delivered.
    (info,) = instance.event_log_storage.get_asset_check_partition_info([CHECK], partition_keys=[DAY.isoformat()])
    assert info.latest_execution_status.value == "FAILED" and info.is_current


def test_a_day_scored_before_its_deadline_raises_nothing(
    instance: DagsterInstance, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The materialization is stamped with the real clock: a deadline a week after yesterday is ahead of it.
    monkeypatch.setenv("TANDEM_PREDICTIONS_DEADLINE_DAYS_AFTER", "7")
    day = datetime.now(UTC).date() - timedelta(days=1)
    instance.report_runless_asset_event(AssetMaterialization(PREDICTIONS, partition=day.isoformat()))
    due = DeadlineSettings().due(day)
    with WebhookReceiver() as receiver:
        monkeypatch.setenv("TANDEM_ALERT_WEBHOOK_URL", receiver.url)
        result = _tick(instance, day, due + timedelta(seconds=30))
    assert receiver.received == []
    assert isinstance(result, SensorResult)
    (evaluation,) = _evaluations(result)
    assert evaluation.partition == day.isoformat() and evaluation.passed


def test_a_day_delivered_after_its_deadline_is_paged_with_its_delivery(
    instance: DagsterInstance, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The daemon was down across the deadline and the run finished late: the day is judged on the
    daemon's return, once, as delivered late."""
    day = datetime.now(UTC).date() - timedelta(days=3)
    instance.report_runless_asset_event(AssetMaterialization(PREDICTIONS, partition=day.isoformat()))
    with WebhookReceiver() as receiver:
        monkeypatch.setenv("TANDEM_ALERT_WEBHOOK_URL", receiver.url)
        result = _tick(instance, day, datetime.now(UTC))
    # The days after it are due too, and missing.
    (body,) = [body for body in receiver.received if body["delivered_at"] is not None]
    assert body["partition"] == day.isoformat()
    assert isinstance(result, SensorResult)
    evaluation = _evaluations(result)[0]
    assert evaluation.partition == day.isoformat()
    assert not evaluation.passed and evaluation.severity == AssetCheckSeverity.WARN


def test_the_check_judges_the_partition_a_run_materializes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Run beside predictions (an operator's materialization, an asset backfill, a rescore by
    declarative automation), the check judges the day's first delivery."""
    monkeypatch.setenv("TANDEM_PREDICTIONS_DEADLINE_DAYS_AFTER", "7")
    today = datetime.now(UTC).date()
    partitions = DailyPartitionsDefinition(start_date=DAY.isoformat(), timezone="UTC")

    @asset(name="predictions", partitions_def=partitions)
    def stand_in() -> None:
        """Materializes nothing but the event the check reads."""

    with DagsterInstance.ephemeral() as instance:
        outcomes = {}
        for day in (DAY, today - timedelta(days=1)):
            result = materialize(
                [stand_in, build_deadline_check(partitions)], partition_key=day.isoformat(), instance=instance
            )
            (evaluation,) = result.get_asset_check_evaluations()
            outcomes[evaluation.partition] = (evaluation.passed, evaluation.severity)
    assert outcomes == {
        DAY.isoformat(): (False, AssetCheckSeverity.WARN),  # first delivered weeks after its deadline
        (today - timedelta(days=1)).isoformat(): (True, AssetCheckSeverity.ERROR),
    }


def test_the_deadline_is_registered_and_no_job_runs_its_check() -> None:
    assert "predictions_deadline_sensor" in {sensor.name for sensor in defs.sensors or []}
    graph = defs.get_repository_def().asset_graph
    assert CHECK in graph.asset_check_keys
    for job_name in ("daily_scoring", "rescore_predictions"):
        assert CHECK not in defs.resolve_job_def(job_name).asset_layer.asset_graph.asset_check_keys, job_name
