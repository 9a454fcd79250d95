"""The one Dagster composition root: `defs`, loaded by workspace.yaml."""

from __future__ import annotations

import warnings

from dagster import (
    AssetSelection,
    AssetSpec,
    BetaWarning,
    DailyPartitionsDefinition,
    Definitions,
    build_schedule_from_partitioned_job,
    define_asset_job,
    in_process_executor,
)

from assets.agreement import build_agreement_assets
from assets.batch import build_batch_assets
from orchestration.resources import DatabaseResource, ModelStoreResource, TransactionSourceResource
from orchestration.sensors import (
    DAILY_JOB,
    INGEST_JOB,
    ONLINE_PREDICTIONS,
    RESCORE_JOB,
    SensorSettings,
    build_landing_sensor,
    build_online_observer,
    build_sensors,
)
from orchestration.settings import OrchestrationSettings

# Backfill policies and partition mappings are beta in Dagster 1.13; we rely on them deliberately.
warnings.filterwarnings("ignore", category=BetaWarning)


def build_definitions(settings: OrchestrationSettings) -> Definitions:
    partitions = DailyPartitionsDefinition(start_date=settings.partitions_start, timezone="UTC")
    batch_assets = build_batch_assets(partitions, settings.history_length)
    agreement_assets = build_agreement_assets(partitions)
    daily_job = define_asset_job(
        DAILY_JOB,
        selection=AssetSelection.assets("transactions", "predictions", "path_agreement"),
        description="Ingest and score one UTC day, then compare it with the online answers.",
    )
    rescore_job = define_asset_job(
        RESCORE_JOB,
        selection=AssetSelection.assets("predictions", "path_agreement"),
        description="Rescore stored partitions (late records, a promoted model) and compare them again.",
    )
    ingest_job = define_asset_job(
        INGEST_JOB,
        selection=AssetSelection.assets("transactions"),
        description="Re-ingest days whose source files changed; late_records_sensor rescores what that changed.",
    )
    nightly = build_schedule_from_partitioned_job(
        daily_job,
        name="daily_scoring_schedule",
        hour_of_day=settings.schedule_hour_utc,
        minute_of_hour=settings.schedule_minute,
        description="Scores yesterday's partition every night.",
    )
    # The online path, as Dagster sees it: written by the BentoML service, not by a run, so an
    # external asset downstream of the same model, observed from the table by a sensor.
    online_predictions = AssetSpec(
        ONLINE_PREDICTIONS,
        deps=["risk_model"],
        group_name="online",
        kinds={"bentoml"},
        description="Online risk scores written by the BentoML service (path=online), observed from `predictions`.",
    )
    sensor_settings = SensorSettings()
    return Definitions(
        assets=[*batch_assets, *agreement_assets, online_predictions],
        jobs=[daily_job, rescore_job, ingest_job],
        schedules=[nightly],
        sensors=[
            *build_sensors(sensor_settings, history_length=settings.history_length),
            build_online_observer(sensor_settings),
            build_landing_sensor(sensor_settings, partitions=partitions, jobs=[daily_job, ingest_job]),
        ],
        resources={
            "database": DatabaseResource(),
            "model_store": ModelStoreResource(),
            "source": TransactionSourceResource(),
        },
        # One process per run: a partition's fixed cost (imports, model load) is paid once, not per step.
        executor=in_process_executor,
    )


defs = build_definitions(OrchestrationSettings())
