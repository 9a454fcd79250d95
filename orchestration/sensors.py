"""Sensors that request runs for exactly the partitions a change touched.

Run keys carry the model version and the change's watermark, so each change is requested once and
a failed run can still be re-executed (Dagster #15982: a failed run key is never re-emitted). Each
tick reads every changed partition from the tables, so several partitions landing in one interval
are all seen (Dagster #32853 affects `@asset_sensor`, which these are not).
"""

from __future__ import annotations

import json
from datetime import datetime, timedelta

from dagster import (
    AssetKey,
    AssetObservation,
    DefaultSensorStatus,
    MetadataValue,
    RunRequest,
    SensorDefinition,
    SensorEvaluationContext,
    SensorResult,
    SkipReason,
    sensor,
)
from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from inference.store import (
    PartitionChange,
    fixed_rejection_partitions,
    online_activity,
    scored_partition_keys,
    stale_scored_partitions,
)
from orchestration.resources import DatabaseResource, ModelStoreResource

DAILY_JOB = "daily_scoring"
RESCORE_JOB = "rescore_predictions"
ONLINE_PREDICTIONS = AssetKey("online_predictions")


class SensorSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="TANDEM_SENSOR_", extra="ignore")

    interval_seconds: int = Field(default=30, ge=5)
    promotion_rescore_partitions: int = Field(default=7, ge=0, description="last N partitions rescored on promotion")


# A row's ingested_at is stamped before its transaction commits, so a row can become visible after
# a tick already moved the watermark past it. Each tick therefore looks back this far again; run
# keys (partition + model + change watermark) make the re-seen changes no-ops.
WATERMARK_OVERLAP = timedelta(minutes=10)


def _watermark(cursor: str | None) -> datetime | None:
    return datetime.fromisoformat(json.loads(cursor)["watermark"]) if cursor else None


def _look_back_from(cursor: str | None) -> datetime | None:
    watermark = _watermark(cursor)
    return watermark - WATERMARK_OVERLAP if watermark is not None else None


def _cursor(moment: datetime) -> str:
    return json.dumps({"watermark": moment.isoformat()})


def _advance(cursor: str | None, changes: list[PartitionChange]) -> str:
    """The newest watermark seen; never backwards, although ticks look back past it."""
    moments = [change.watermark for change in changes]
    if (previous := _watermark(cursor)) is not None:
        moments.append(previous)
    return _cursor(max(moments))


def _rerun(
    changes: list[PartitionChange], *, trigger: str, key_prefix: str, version: str, cursor: str | None
) -> SensorResult:
    """One run per changed partition, keyed by partition, model version and change watermark."""
    return SensorResult(
        run_requests=[
            RunRequest(
                run_key=f"{key_prefix}:{change.partition_key}:{version}:{change.watermark.isoformat()}",
                partition_key=change.partition_key,
                tags={"tandem/trigger": trigger, "tandem/model_version": version},
            )
            for change in changes
        ],
        cursor=_advance(cursor, changes),
    )


def build_sensors(settings: SensorSettings, *, history_length: int) -> list[SensorDefinition]:
    @sensor(
        job_name=RESCORE_JOB,
        minimum_interval_seconds=settings.interval_seconds,
        default_status=DefaultSensorStatus.RUNNING,
        description="Late or corrected source records -> rescore their partitions and those of the "
        "records whose history they are (already scored partitions only).",
    )
    def late_records_sensor(
        context: SensorEvaluationContext, database: DatabaseResource, model_store: ModelStoreResource
    ) -> SensorResult | SkipReason:
        version = model_store.production_tag()
        if version is None:
            return SkipReason("no production model yet")
        with database.engine.connect() as conn:
            changes = stale_scored_partitions(
                conn, changed_after=_look_back_from(context.cursor), history_length=history_length
            )
        if not changes:
            return SkipReason("no changed records in scored partitions")
        return _rerun(changes, trigger="late_records", key_prefix="late", version=version, cursor=context.cursor)

    @sensor(
        job_name=DAILY_JOB,
        minimum_interval_seconds=settings.interval_seconds,
        default_status=DefaultSensorStatus.RUNNING,
        description="Quarantined records marked fixed -> re-ingest and rescore their partitions.",
    )
    def fixed_rejects_sensor(
        context: SensorEvaluationContext, database: DatabaseResource, model_store: ModelStoreResource
    ) -> SensorResult | SkipReason:
        version = model_store.production_tag() or "none"
        with database.engine.connect() as conn:
            changes = fixed_rejection_partitions(conn, resolved_after=_look_back_from(context.cursor))
        if not changes:
            return SkipReason("no rejections marked fixed")
        return _rerun(changes, trigger="fixed_rejects", key_prefix="fixed", version=version, cursor=context.cursor)

    @sensor(
        job_name=RESCORE_JOB,
        minimum_interval_seconds=settings.interval_seconds,
        default_status=DefaultSensorStatus.RUNNING,
        description=f"A promoted model -> rescore the last {settings.promotion_rescore_partitions} scored partitions.",
    )
    def model_promotion_sensor(
        context: SensorEvaluationContext, database: DatabaseResource, model_store: ModelStoreResource
    ) -> SensorResult | SkipReason:
        version = model_store.production_tag()
        if version is None or version == context.cursor:
            return SkipReason(f"production model unchanged ({version})")
        if context.cursor is None:
            # First tick: remember what is in production without rescoring history under it.
            return SensorResult(run_requests=[], cursor=version)
        with database.engine.connect() as conn:
            keys = (
                scored_partition_keys(conn)[-settings.promotion_rescore_partitions :]
                if settings.promotion_rescore_partitions
                else []
            )
        return SensorResult(
            run_requests=[
                RunRequest(
                    run_key=f"promoted:{key}:{version}",
                    partition_key=key,
                    tags={"tandem/trigger": "model_promotion", "tandem/model_version": version},
                )
                for key in keys
            ],
            cursor=version,
        )

    return [late_records_sensor, fixed_rejects_sensor, model_promotion_sensor]


def build_online_observer(settings: SensorSettings) -> SensorDefinition:
    @sensor(
        minimum_interval_seconds=settings.interval_seconds,
        default_status=DefaultSensorStatus.RUNNING,
        description="Reports what the online service wrote to `predictions` as observations of online_predictions.",
    )
    def online_predictions_observer(
        context: SensorEvaluationContext, database: DatabaseResource
    ) -> SensorResult | SkipReason:
        with database.engine.connect() as conn:
            activity = online_activity(conn, produced_after=_watermark(context.cursor))
        if activity.rows == 0 or activity.latest is None:
            return SkipReason("no new online results")
        observation = AssetObservation(
            asset_key=ONLINE_PREDICTIONS,
            metadata={
                "rows": activity.rows,
                "requests": activity.requests,
                "model_versions": MetadataValue.json(activity.model_versions),
                "latency_ms_p50": activity.latency_ms_p50 if activity.latency_ms_p50 is not None else float("nan"),
                "latency_ms_p99": activity.latency_ms_p99 if activity.latency_ms_p99 is not None else float("nan"),
                "latest_produced_at": activity.latest.isoformat(),
            },
        )
        return SensorResult(asset_events=[observation], cursor=_cursor(activity.latest))

    return online_predictions_observer
