"""The one Dagster composition root: `defs`, loaded by workspace.yaml."""

from __future__ import annotations

import warnings

from dagster import (
    AssetSelection,
    AssetSpec,
    AutomationConditionSensorDefinition,
    BetaWarning,
    DailyPartitionsDefinition,
    Definitions,
    PreviewWarning,
    define_asset_job,
    in_process_executor,
)
from pydantic import ValidationError
from pydantic_settings import BaseSettings

from assets.agreement import build_agreement_assets
from assets.automation import PRODUCTION_MODEL
from assets.batch import build_batch_assets
from assets.challenger import build_challenger_assets
from assets.deadline import build_deadline_check
from assets.resources import DatabaseResource, ModelStoreResource, RecordSourceResource
from assets.scoring import records_key
from inference.settings import TandemSettings, settings_error
from inference.spec import LoadedSpec, configured_spec
from orchestration.alerts import build_run_failure_alert
from orchestration.deadline import build_deadline_sensor
from orchestration.sensors import (
    DAILY_JOB,
    ONLINE_PREDICTIONS,
    RESCORE_JOB,
    SensorSettings,
    build_landing_sensor,
    build_nightly_schedule,
    build_online_observer,
    build_production_model_observer,
    build_sensors,
    ingest_job_name,
)
from orchestration.settings import OrchestrationSettings

REPLAY_CHALLENGER_JOB = "replay_challenger"

# Backfill policies and partition mappings are beta in Dagster 1.13, partitioned asset checks a
# preview; we rely on them deliberately.
warnings.filterwarnings("ignore", category=BetaWarning)
warnings.filterwarnings("ignore", category=PreviewWarning)


def asset_jobs(ls: LoadedSpec) -> list[tuple[str, tuple[str, ...], str]]:
    """(name, assets, description) of each job the sensors, the schedule and operators launch."""
    records = ls.spec.name
    return [
        (
            DAILY_JOB,
            (records, "predictions", "path_agreement"),
            "Ingest and score one UTC day, then compare it with the online answers.",
        ),
        (
            RESCORE_JOB,
            ("predictions", "path_agreement"),
            "Rescore stored partitions (late records, a promoted model) and compare them again.",
        ),
        (
            ingest_job_name(records_key(ls)),
            (records,),
            "Re-ingest days whose source files changed; late_records_sensor rescores what that changed.",
        ),
        (
            REPLAY_CHALLENGER_JOB,
            ("challenger_predictions",),
            "Replay stored days with the challenger (a backfill over labelled days is its backtest).",
        ),
    ]


def build_definitions(settings: OrchestrationSettings) -> Definitions:
    partitions = DailyPartitionsDefinition(start_date=settings.partitions_start.isoformat(), timezone="UTC")
    sensor_settings = SensorSettings()
    spec = configured_spec()
    batch_assets = build_batch_assets(
        spec,
        partitions,
        settings.history_length,
        rescore_days=sensor_settings.promotion_rescore_partitions,
    )
    agreement_assets = build_agreement_assets(partitions)
    deadline_check = build_deadline_check(partitions)
    # The deadline is judged by predictions_deadline_sensor when it passes, not by each run: a
    # job's backfill of last month's days is not a page about last month.
    jobs = {
        name: define_asset_job(
            name,
            selection=AssetSelection.assets(*selected) - AssetSelection.checks(deadline_check),
            description=description,
        )
        for name, selected, description in asset_jobs(spec)
    }
    daily_job, ingest_job = jobs[DAILY_JOB], jobs[ingest_job_name(records_key(spec))]
    nightly = build_nightly_schedule(
        daily_job,
        partitions,
        hour=settings.schedule_hour_utc,
        minute=settings.schedule_minute,
        records=records_key(spec),
    )
    # The online path, as Dagster sees it: written by the BentoML service, not by a run, so an
    # external asset downstream of the same production model, observed from the table by a sensor.
    online_predictions = AssetSpec(
        ONLINE_PREDICTIONS,
        deps=[PRODUCTION_MODEL],
        group_name="online",
        kinds={"bentoml"},
        description="Online scores written by the BentoML service (path=online), observed from `predictions`.",
    )
    # The daemon evaluates the assets' AutomationConditions (assets/automation.py) through this
    # sensor; running by default, as the custom sensors are. One run per partition (no backfill), so
    # each rescore is a run of its own with the sensor's tags, like the sensors' runs.
    automation = AutomationConditionSensorDefinition(
        "scoring_automation_sensor",
        target=AssetSelection.assets("predictions", "path_agreement"),
        **sensor_settings.sensor_args(),
        run_tags={"tandem/trigger": "automation"},
        emit_backfills=False,
        description="Rescores the last scored days after the production model moves or predictions' code version "
        "is bumped, and recomputes path_agreement after its day's predictions change.",
    )
    return Definitions(
        assets=[*batch_assets, *agreement_assets, online_predictions, *build_challenger_assets(spec, partitions)],
        asset_checks=[deadline_check],
        jobs=list(jobs.values()),
        schedules=[nightly],
        sensors=[
            *build_sensors(sensor_settings, partitions=partitions),
            automation,
            build_production_model_observer(sensor_settings),
            build_online_observer(sensor_settings),
            build_online_observer(sensor_settings, shadow=True),
            build_run_failure_alert(sensor_settings.interval_seconds),
            build_deadline_sensor(sensor_settings, partitions=partitions),
            build_landing_sensor(
                sensor_settings, partitions=partitions, jobs=[daily_job, ingest_job], records=records_key(spec)
            ),
        ],
        resources={
            "database": DatabaseResource(),
            "model_store": ModelStoreResource(model_name=TandemSettings().model_name),
            "source": RecordSourceResource(),
        },
        # One process per run: a partition's fixed cost (imports, model load) is paid once, not per step.
        executor=in_process_executor,
    )


class SettingsRefused(Exception):
    """A setting of the environment refused, in one line naming its variable: Dagster shows the
    code location's load error, and pydantic's own text names a Python field over several lines."""


def checked_settings() -> OrchestrationSettings:
    """Every settings class the code location and its runs read, checked as it loads."""
    read: dict[str, type[BaseSettings]] = {
        settings.__name__: settings for settings in (TandemSettings, OrchestrationSettings, SensorSettings)
    }
    try:
        TandemSettings(), SensorSettings()
        return OrchestrationSettings()
    except ValidationError as error:
        raise SettingsRefused(settings_error(error, read[error.title])) from None


defs = build_definitions(checked_settings())
