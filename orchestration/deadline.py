"""The deadline, enforced: each day whose predictions deadline passed is judged once, at the first
tick after it, whether or not a run of it ever started (the nightly run that never ran is the
failure this exists for). A late day becomes a failed `delivered_by_deadline` evaluation on its
partition and one alert through the run-failure webhook; a punctual day a passed evaluation.

The cursor is the last day judged, so a day is judged (and paged) once; a daemon that was down
judges on its return the days it missed, as far back as TANDEM_DEADLINE_LOOKBACK_DAYS.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Collection
from datetime import date, datetime, timedelta
from typing import Any

from dagster import (
    DailyPartitionsDefinition,
    SensorDefinition,
    SensorEvaluationContext,
    SensorResult,
    SkipReason,
    sensor,
)

from assets.deadline import Delivery, judge
from assets.settings import DeadlineSettings
from inference.store import utc_now
from orchestration.alerts import AlertSettings, post_alert
from orchestration.runs import partitions_in_flight
from orchestration.sensors import SensorSettings


def deadline_payload(delivery: Delivery, *, run_in_flight: bool, ui_url: str) -> dict[str, Any]:
    return {
        "event": "predictions_deadline_missed",
        "partition": delivery.day,
        "deadline": delivery.due.isoformat(),
        "delivered_at": delivery.delivered_at.isoformat() if delivery.delivered_at is not None else None,
        "run_in_flight": run_in_flight,
        "summary": delivery.describe(),
        "url": f"{ui_url.rstrip('/')}/assets/predictions?view=partitions&partition={delivery.day}",
    }


def _days(first: date, last: date) -> list[date]:
    return [first + timedelta(days=offset) for offset in range((last - first).days + 1)]


def _alert(context: SensorEvaluationContext, delivery: Delivery, busy: Collection[str]) -> None:
    """Posts one missed deadline; a webhook that fails is logged, as for a failed run."""
    settings = AlertSettings()
    in_flight = delivery.day in busy
    what = f"deadline missed, {delivery.describe()} ({'a run of it is in flight' if in_flight else 'no run in flight'})"
    if not settings.alert_webhook_url:
        context.log.warning(f"{what}; TANDEM_ALERT_WEBHOOK_URL is unset, no alert sent")
        return
    payload = deadline_payload(delivery, run_in_flight=in_flight, ui_url=settings.dagster_ui_url)
    problem = post_alert(settings.alert_webhook_url, payload, settings.alert_timeout_s)
    if problem is None:
        context.log.warning(f"{what}; alert sent")
    else:
        context.log.error(f"{what}; the alert webhook failed, not retried: {problem}")


def build_deadline_sensor(
    settings: SensorSettings, *, partitions: DailyPartitionsDefinition, clock: Callable[[], datetime] = utc_now
) -> SensorDefinition:
    @sensor(
        name="predictions_deadline_sensor",
        **settings.sensor_args(),
        description="Each day whose predictions deadline passed (TANDEM_PREDICTIONS_DEADLINE_UTC, 08:00 UTC the next "
        "day by default) -> a delivered_by_deadline evaluation on its partition; a late day also -> one JSON POST "
        "to TANDEM_ALERT_WEBHOOK_URL (a log line when it is unset).",
    )
    def predictions_deadline_sensor(context: SensorEvaluationContext) -> SensorResult | SkipReason:
        deadline = DeadlineSettings()
        now = clock()
        last = deadline.last_due_day(now)
        first = last - timedelta(days=deadline.deadline_lookback_days - 1)
        judged = date.fromisoformat(json.loads(context.cursor)["judged_through"]) if context.cursor else None
        if judged is not None:
            if judged >= last:
                upcoming = deadline.due(judged + timedelta(days=1))
                return SkipReason(f"judged through {judged}; the next deadline is {upcoming:%Y-%m-%d %H:%M} UTC")
            if judged + timedelta(days=1) < first:
                context.log.warning(f"days after {judged} and before {first} are older than the lookback: not judged")
            first = max(first, judged + timedelta(days=1))
        # Before the first partition, or after the last: no predictions are owed.
        days = [day.isoformat() for day in _days(first, last) if partitions.has_partition_key(day.isoformat())]
        deliveries = [judge(context.instance, day, deadline, now) for day in days]
        late = [delivery for delivery in deliveries if delivery.late]
        busy = partitions_in_flight(context.instance, partitions) if late else set()
        for delivery in deliveries:
            if delivery.late:
                _alert(context, delivery, busy)
            else:
                context.log.info(f"on time, {delivery.describe()}")
        return SensorResult(
            asset_events=[delivery.evaluation() for delivery in deliveries],
            cursor=json.dumps({"judged_through": last.isoformat()}),
        )

    return predictions_deadline_sensor
