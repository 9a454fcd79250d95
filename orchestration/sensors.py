"""Sensors that request runs for exactly the partitions a change touched, and that report what
happens outside Dagster (the online path's writes, the production model pointer) as observations.

Reruns that Dagster's declarative automation can express are AutomationConditions instead (a
promotion's rescore, path_agreement after predictions: assets/automation.py). What stays here reads
row-level changes from the tables, which no Dagster event describes.

Run keys carry the model version and the change's watermark, so each change is requested once and
a failed run can still be re-executed (Dagster #15982: a failed run key is never re-emitted). Each
tick reads every changed partition from the tables, so several partitions landing in one interval
are all seen (Dagster #32853 affects `@asset_sensor`, which these are not).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from collections.abc import Set as AbstractSet
from datetime import datetime, timedelta
from typing import Any

from dagster import (
    AssetKey,
    AssetObservation,
    AssetRecordsFilter,
    DagsterInstance,
    DefaultSensorStatus,
    EventLogRecord,
    MetadataValue,
    PartitionsDefinition,
    RunRequest,
    ScheduleDefinition,
    ScheduleEvaluationContext,
    SensorDefinition,
    SensorEvaluationContext,
    SensorResult,
    SkipReason,
    TimestampMetadataValue,
    schedule,
    sensor,
)
from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from assets.automation import CHALLENGER_MODEL, PRODUCTION_MODEL, SHADOW_PREDICTIONS
from assets.metadata import STORE_READ_FROM
from assets.model import NO_CHALLENGER, challenger_model_observation, production_model_observation
from assets.resources import DatabaseResource, ModelStoreResource, RecordSourceResource
from inference.store import (
    PartitionChange,
    fixed_rejection_partitions,
    online_activity,
    stale_scored_partitions,
    utc_now,
)
from orchestration.runs import partitions_in_flight

# What define_asset_job returns: Dagster does not export its type.
AssetJob = Any

DAILY_JOB = "daily_scoring"
RESCORE_JOB = "rescore_predictions"
ONLINE_PREDICTIONS = AssetKey("online_predictions")
PREDICTIONS = AssetKey("predictions")


def ingest_job_name(records: AssetKey) -> str:
    """The job that re-ingests changed days: named after the spec's records (`ingest_transactions`)."""
    return f"ingest_{records.to_python_identifier()}"


class SensorSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="TANDEM_SENSOR_", extra="ignore")

    interval_seconds: int = Field(default=30, ge=5)
    promotion_rescore_partitions: int = Field(
        default=7,
        ge=0,
        description="a promotion (or a bump of predictions' code version) rescores the days among the last N that "
        "were scored; 0: none",
    )

    def sensor_args(self) -> dict[str, Any]:
        """What every Tandem sensor is declared with: this interval, and running from the first
        deployment on (nothing to switch on in the UI)."""
        return {"minimum_interval_seconds": self.interval_seconds, "default_status": DefaultSensorStatus.RUNNING}


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


def _advance(
    cursor: str | None, changes: list[PartitionChange], held: list[PartitionChange], now: datetime | None = None
) -> str:
    """The newest watermark seen (or `now`, the tick's start, when later), but not past a held
    change, so that the next ticks read it again (they look back WATERMARK_OVERLAP from the
    cursor); never backwards."""
    moments = [change.watermark for change in changes] + ([now] if now is not None else [])
    newest = min([max(moments), *(change.watermark for change in held)])
    if (previous := _watermark(cursor)) is not None:
        newest = max(newest, previous)
    return _cursor(newest)


def _rerun(
    context: SensorEvaluationContext,
    changes: list[PartitionChange],
    *,
    partitions: PartitionsDefinition,
    trigger: str,
    key_prefix: str,
    version: str,
    busy: AbstractSet[str] = frozenset(),
    now: datetime | None = None,
) -> SensorResult:
    """One run per changed partition, keyed by partition, model version and change watermark.

    A changed day the partition set does not have (not over yet: the demo writes today's rows; or
    before a partitions start moved forward) is left out, but the cursor still moves past it: one
    request for it would fail the whole tick, and every tick after it, holding back the valid days.
    A `busy` day is left out too, and the cursor held before its change, for a later tick.
    """
    unknown = sorted(c.partition_key for c in changes if not partitions.has_partition_key(c.partition_key))
    if unknown:
        context.log.info(f"{key_prefix}: {', '.join(unknown)} not a partition (yet); skipped")
    held = [c for c in changes if c.partition_key in busy and c.partition_key not in unknown]
    if held:
        # DEBUG: every tick says it again until that run ends.
        context.log.debug(
            f"{key_prefix}: {', '.join(c.partition_key for c in held)} has a run in flight; left for later"
        )
    return SensorResult(
        run_requests=[
            RunRequest(
                run_key=f"{key_prefix}:{change.partition_key}:{version}:{change.watermark.isoformat()}",
                partition_key=change.partition_key,
                tags={"tandem/trigger": trigger, "tandem/model_version": version},
            )
            for change in changes
            if change.partition_key not in unknown and change.partition_key not in busy
        ],
        cursor=_advance(context.cursor, changes, held, now),
    )


def build_sensors(settings: SensorSettings, *, partitions: PartitionsDefinition) -> list[SensorDefinition]:
    # Not an AutomationCondition: which later partitions read a changed record as history (the
    # account's next records) is row-level knowledge in the tables; conditions see partitions.
    @sensor(
        job_name=RESCORE_JOB,
        **settings.sensor_args(),
        description="Late or corrected source records -> rescore their partitions and those of the "
        "records whose history they are (already scored partitions only).",
    )
    def late_records_sensor(
        context: SensorEvaluationContext, database: DatabaseResource, model_store: ModelStoreResource
    ) -> SensorResult | SkipReason:
        version = model_store.production_tag()
        if version is None:
            return SkipReason("no production model yet")
        # Before the query: a row stamped earlier and committed after it is within the overlap.
        now = utc_now()
        with database.engine.connect() as conn:
            # The production model's own K: the rescore runs with it, so its reach is what changed.
            touched = stale_scored_partitions(
                database.spec,
                conn,
                changed_after=_look_back_from(context.cursor),
                history_length=model_store.history_length(version),
            )
        changes = [c for c in touched if c.unanswered or _scored_before(context.instance, c)]
        if not changes:
            # The cursor moves on: changes already judged are not read again after the overlap.
            return SensorResult(
                skip_reason="no changed records in scored partitions", cursor=_advance(context.cursor, [], [], now)
            )
        # A day's run in flight scores it next (a daily_scoring re-ingest, the rescore requested
        # here): another rescore would score it twice. Once it is over, what is still stale is.
        busy = partitions_in_flight(context.instance, partitions)
        return _rerun(
            context,
            changes,
            partitions=partitions,
            trigger="late_records",
            key_prefix="late",
            version=version,
            busy=busy,
            now=now,
        )

    # Not an AutomationCondition: a rejection marked fixed (`tandem rejects fixed`) is a row update
    # in rejected_records, which Dagster never sees as an event.
    @sensor(
        job_name=DAILY_JOB,
        **settings.sensor_args(),
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
        return _rerun(
            context, changes, partitions=partitions, trigger="fixed_rejects", key_prefix="fixed", version=version
        )

    return [late_records_sensor, fixed_rejects_sensor]


def build_production_model_observer(settings: SensorSettings) -> SensorDefinition:
    """The production pointer, observed: a move that did not come from risk_model (`tandem models
    promote`, `rollback`) becomes a new data version of production_model, so the predictions
    scored under the previous version show as stale and rescore_after_promotion rescores them.

    A sensor, not an AutomationCondition on the observable asset: that would launch an observation
    run (a process, a slot under max_concurrent_runs) every tick; a tick here reads one small file.
    """

    @sensor(
        **settings.sensor_args(),
        description="The production model pointer moved (risk_model, `tandem models promote`, `rollback`) -> "
        "an observation of production_model with the new tag as its data version.",
    )
    def production_model_observer(
        context: SensorEvaluationContext, model_store: ModelStoreResource
    ) -> SensorResult | SkipReason:
        tag = model_store.production_tag()
        if tag is None:
            return SkipReason("no production model yet")
        challenger = model_store.challenger_tag() or NO_CHALLENGER
        events: list[AssetObservation] = []
        # Compared with what Dagster last recorded, not with a cursor: risk_model reports its own
        # moves, and those must not be observed twice.
        for key, version, observation in (
            (PRODUCTION_MODEL, tag, production_model_observation),
            (CHALLENGER_MODEL, challenger, challenger_model_observation),
        ):
            latest = context.instance.fetch_observations(AssetRecordsFilter(asset_key=key), limit=1).records
            observed = latest[0].asset_observation.data_version if latest and latest[0].asset_observation else None
            if observed != version and not (observed is None and version == NO_CHALLENGER):
                context.log.info(f"{key.to_user_string()}: {observed} -> {version}")
                events.append(observation(version))
        if not events:
            return SkipReason(f"production model unchanged ({tag}), challenger {challenger}")
        return SensorResult(asset_events=events)

    return production_model_observer


def build_online_observer(
    settings: SensorSettings, *, shadow: bool = False, clock: Callable[[], datetime] = utc_now
) -> SensorDefinition:
    """What the online service wrote, as observations: its answers (online_predictions, from
    `predictions`) or, with `shadow`, the challenger's beside them (shadow_predictions, from
    `challenger_predictions`).

    The service stamps produced_at when it scores; its writer, or the outbox after a database
    outage, commits the row later with that stamp. So a tick reports the rows produced up to
    WATERMARK_OVERLAP ago, and the cursor is that bound: a row committed within the overlap is
    still reported, and each row once. A cursor at the newest stamp seen would skip every row
    committed after a later-stamped one. Not covered: a row committed more than the overlap
    after its stamp (an outbox drained after a longer outage); a commit-ordered column would be.
    Rejected: looking back past the cursor, which needs every row of the overlap remembered to
    report each once (hundreds of thousands at the service's rates).
    """
    asset_key, name = (SHADOW_PREDICTIONS, "shadow") if shadow else (ONLINE_PREDICTIONS, "online")
    table = "challenger_predictions" if shadow else "predictions"

    @sensor(
        name=f"{name}_predictions_observer",
        **settings.sensor_args(),
        description=f"Reports what the online service wrote to `{table}` as observations of {name}_predictions, "
        f"once {WATERMARK_OVERLAP.seconds // 60} minutes old (the writer and the outbox commit after it scores).",
    )
    def observer(context: SensorEvaluationContext, database: DatabaseResource) -> SensorResult | SkipReason:
        settled = clock() - WATERMARK_OVERLAP
        after = _watermark(context.cursor)
        if after is not None and after >= settled:
            return SkipReason(f"no new {name} results produced before {settled.isoformat()}")
        with database.engine.connect() as conn:
            activity = online_activity(conn, produced_after=after, produced_before=settled, shadow=shadow)
        if activity.rows == 0 or activity.latest is None:
            # The cursor stays: a row of this window committed later still counts.
            return SkipReason(f"no new {name} results produced before {settled.isoformat()}")
        observation = AssetObservation(
            asset_key=asset_key,
            metadata={
                "rows": activity.rows,
                "requests": activity.requests,
                "model_versions": MetadataValue.json(activity.model_versions),
                "latency_ms_p50": activity.latency_ms_p50 if activity.latency_ms_p50 is not None else float("nan"),
                "latency_ms_p99": activity.latency_ms_p99 if activity.latency_ms_p99 is not None else float("nan"),
                "latest_produced_at": activity.latest.isoformat(),
                "produced_before": settled.isoformat(),
            },
        )
        return SensorResult(asset_events=[observation], cursor=_cursor(settled))

    return observer


def _last_ingest(instance: DagsterInstance, records_asset: AssetKey, partition_key: str) -> tuple[str | None, str]:
    """The file version the latest materialization of the records asset of this day read, if any, and
    that materialization named for a run key ('none' before the first): `version@storage id`."""
    records = instance.fetch_materializations(
        AssetRecordsFilter(asset_key=records_asset, asset_partitions=[partition_key]), limit=1
    ).records
    if not records or records[0].asset_materialization is None:
        return None, "none"
    version = records[0].asset_materialization.metadata.get("source_version")
    read = str(version.value) if version is not None else None
    return read, f"{read}@{records[0].storage_id}"


def _latest_scoring(instance: DagsterInstance, partition_key: str) -> EventLogRecord | None:
    records = instance.fetch_materializations(
        AssetRecordsFilter(asset_key=PREDICTIONS, asset_partitions=[partition_key]), limit=1
    ).records
    return records[0] if records else None


def _is_scored(instance: DagsterInstance, partition_key: str) -> bool:
    return _latest_scoring(instance, partition_key) is not None


def _scored_before(instance: DagsterInstance, change: PartitionChange) -> bool:
    """Whether the partition's last batch scoring began reading the store before `change` (or
    does not say when: scored outside Dagster, or by an older Tandem): then it may lack the change."""
    latest = _latest_scoring(instance, change.partition_key)
    materialization = latest.asset_materialization if latest is not None else None
    read_from = materialization.metadata.get(STORE_READ_FROM) if materialization is not None else None
    if not isinstance(read_from, TimestampMetadataValue):
        return True
    return read_from.value < change.watermark.timestamp()


def build_landing_sensor(
    settings: SensorSettings,
    *,
    partitions: PartitionsDefinition,
    jobs: Sequence[AssetJob],
    records: AssetKey,
) -> SensorDefinition:
    """Files landing for a day -> ingest and score it; a day's file changing -> re-ingest it.

    Not an AutomationCondition: the files are outside Dagster, and observing them as an asset
    would cost a run per observation; which job a day needs also depends on whether it is scored.

    The cursor is {day: file version}. A day already ingested from this very version (the demo
    writes its file inside the ingest, a run started by hand) requests nothing; a day with a run in
    flight is looked at again next tick. A changed day that is already scored only re-ingests:
    `late_records_sensor` then rescores exactly the partitions whose records or history changed.
    """

    @sensor(
        jobs=list(jobs),
        **settings.sensor_args(),
        description="New day files in the landing location -> daily_scoring; a changed day file -> "
        f"{ingest_job_name(records)} (late_records_sensor then rescores what changed). Demo and files sources.",
    )
    def landing_sensor(context: SensorEvaluationContext, source: RecordSourceResource) -> SensorResult | SkipReason:
        files = source.file_source()
        if files is None:
            return SkipReason("the source is a SQL query: no landing location to watch")
        seen: dict[str, str] = json.loads(context.cursor) if context.cursor else {}
        requests: list[RunRequest] = []
        versions = files.versions()
        # Looked up after listing the files: a run that wrote one of them is still seen in flight.
        busy = partitions_in_flight(context.instance, partitions)
        outside: list[str] = []
        for day, version in sorted(versions.items()):
            key = day.isoformat()
            if seen.get(key) == version:
                continue
            if not partitions.has_partition_key(key):
                # Before the first partition, or a day not over yet (a key outside the set is refused).
                outside.append(key)
                continue
            if key in busy:
                continue  # maybe writing this very file (the demo): decide once it is done
            ingested, last_ingest = _last_ingest(context.instance, records, key)
            if ingested != version:
                job = ingest_job_name(records) if _is_scored(context.instance, key) else DAILY_JOB
                requests.append(
                    RunRequest(
                        # From the day's last ingest to this file: keyed by the file alone, a file
                        # restored to a version ingested before repeated that run's key, and Dagster
                        # dropped the request. A tick repeated for the same change asks the same key.
                        run_key=f"landing:{key}:{last_ingest}->{version}",
                        job_name=job,
                        partition_key=key,
                        tags={"tandem/trigger": "landing", "tandem/source_version": version},
                    )
                )
            seen[key] = version
        if outside:
            # DEBUG, and said in the tick's skip reason: such a day is seen again every tick until it is over.
            context.log.debug(f"landing: {', '.join(outside)} not a partition (yet); skipped")
        if not requests and json.dumps(seen, sort_keys=True) == (context.cursor or "{}"):
            waiting = f" ({', '.join(outside)}: not partitions, before the first or not over yet)" if outside else ""
            return SkipReason(f"no new or changed day files at {files.location}{waiting}")
        return SensorResult(run_requests=requests, cursor=json.dumps(seen, sort_keys=True))

    return landing_sensor


def build_nightly_schedule(
    job: AssetJob, partitions: PartitionsDefinition, *, hour: int, minute: int, records: AssetKey
) -> ScheduleDefinition:
    """The classic nightly run: yesterday's partition at hour:minute UTC, unless that day was
    ingested already or a run of it is in flight. `landing_sensor` runs a day as soon as its file
    lands; a schedule derived from the partitioned job ran it again at 02:00 (it deduplicates only
    against its own runs), scoring every day twice."""

    @schedule(
        name="daily_scoring_schedule",
        job=job,
        cron_schedule=f"{minute} {hour} * * *",
        execution_timezone="UTC",
        description="Scores yesterday's partition every night, unless it was ingested already (landing_sensor) "
        "or a run of it is in flight.",
    )
    def nightly(context: ScheduleEvaluationContext) -> RunRequest | SkipReason:
        scheduled = context.scheduled_execution_time or utc_now()
        day = (scheduled - timedelta(days=1)).date().isoformat()
        if not partitions.has_partition_key(day):
            return SkipReason(f"{day} is not a partition")
        if day in partitions_in_flight(context.instance, partitions):
            return SkipReason(f"a run of {day} is in flight")
        version, last_ingest = _last_ingest(context.instance, records, day)
        if last_ingest != "none":
            return SkipReason(f"{day} was ingested already (source version {version})")
        return RunRequest(run_key=day, partition_key=day, tags={"tandem/trigger": "schedule"})

    return nightly
