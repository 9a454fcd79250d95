"""The batch path's deadline: a day's `predictions` delivered by a set time (08:00 UTC the next
day unless TANDEM_PREDICTIONS_DEADLINE_UTC says otherwise), judged per partition.

A partitioned asset check, not a `FreshnessPolicy`: Dagster's policies judge the asset's latest
materialization of any partition, so a rescore of last week marks the asset fresh while yesterday
is missing (docs/decisions/0008-the-batch-path-owns-its-deadline.md).

Delivered means the day's first `predictions` materialization: a later rescore neither makes a
late day punctual nor a punctual day late.
"""

# No `from __future__ import annotations`: @asset_check compares the context's annotation with
# the class itself, and refuses the string that import would leave.
from dataclasses import dataclass
from datetime import UTC, date, datetime

from dagster import (
    AssetCheckEvaluation,
    AssetCheckExecutionContext,
    AssetCheckResult,
    AssetChecksDefinition,
    AssetCheckSeverity,
    AssetKey,
    AssetRecordsFilter,
    DagsterInstance,
    DailyPartitionsDefinition,
    MetadataValue,
    asset_check,
)

from assets.settings import DeadlineSettings
from inference.store import utc_now

PREDICTIONS = AssetKey("predictions")
DEADLINE_CHECK = "delivered_by_deadline"


def first_delivery(instance: DagsterInstance, day: str) -> datetime | None:
    """When the day's predictions were first materialized, if ever."""
    records = instance.fetch_materializations(
        AssetRecordsFilter(asset_key=PREDICTIONS, asset_partitions=[day]), limit=1, ascending=True
    ).records
    return datetime.fromtimestamp(records[0].timestamp, UTC) if records else None


@dataclass(frozen=True)
class Delivery:
    """One day judged against its deadline at `now`."""

    day: str
    due: datetime
    delivered_at: datetime | None
    now: datetime

    @property
    def on_time(self) -> bool:
        return self.delivered_at is not None and self.delivered_at <= self.due

    @property
    def late(self) -> bool:
        """Missed: delivered after the deadline, or not delivered and the deadline has passed."""
        return not self.on_time and (self.delivered_at is not None or self.now >= self.due)

    @property
    def severity(self) -> AssetCheckSeverity:
        # Delivered late is history to explain; missing is an incident to act on.
        return AssetCheckSeverity.WARN if self.late and self.delivered_at is not None else AssetCheckSeverity.ERROR

    def describe(self) -> str:
        due = f"{self.due:%Y-%m-%d %H:%M} UTC"
        if self.delivered_at is None:
            return f"{self.day}: no predictions at {due}" if self.late else f"{self.day}: due at {due}"
        minutes = abs(self.delivered_at - self.due).total_seconds() / 60
        when = "after" if self.late else "before"
        return f"{self.day}: delivered {self.delivered_at:%Y-%m-%d %H:%M} UTC, {minutes:.0f} min {when} {due}"

    def metadata(self) -> dict[str, MetadataValue]:
        return {
            "due": MetadataValue.timestamp(self.due),
            "delivered_at": (
                MetadataValue.timestamp(self.delivered_at) if self.delivered_at is not None else MetadataValue.null()
            ),
            "late_minutes": MetadataValue.float(
                round(((self.delivered_at or self.now) - self.due).total_seconds() / 60, 1) if self.late else 0.0
            ),
        }

    def evaluation(self) -> AssetCheckEvaluation:
        """The outcome as a runless check evaluation: what a sensor reports."""
        return AssetCheckEvaluation(
            asset_key=PREDICTIONS,
            check_name=DEADLINE_CHECK,
            passed=not self.late,
            severity=self.severity,
            description=self.describe(),
            metadata=self.metadata(),
            partition=self.day,
        )


def judge(instance: DagsterInstance, day: str, settings: DeadlineSettings, now: datetime) -> Delivery:
    return Delivery(
        day=day, due=settings.due(date.fromisoformat(day)), delivered_at=first_delivery(instance, day), now=now
    )


def build_deadline_check(partitions: DailyPartitionsDefinition) -> AssetChecksDefinition:
    """The check an operator, an asset backfill or a rescore by declarative automation runs beside
    `predictions`; `predictions_deadline_sensor` reports it for a day nothing delivered."""

    @asset_check(
        asset=PREDICTIONS,
        name=DEADLINE_CHECK,
        partitions_def=partitions,
        description="The day's predictions were first materialized by its deadline (TANDEM_PREDICTIONS_DEADLINE_UTC, "
        "08:00 UTC the next day by default). Fails as an ERROR for a day missing at its deadline, as a WARN for "
        "a day delivered after it.",
    )
    def delivered_by_deadline(context: AssetCheckExecutionContext) -> AssetCheckResult:
        delivery = judge(context.instance, context.partition_key, DeadlineSettings(), utc_now())
        return AssetCheckResult(
            passed=not delivery.late,
            severity=delivery.severity,
            description=delivery.describe(),
            metadata=delivery.metadata(),
        )

    return delivered_by_deadline
