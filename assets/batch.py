"""The batch path's assets: daily source records, the risk model, daily predictions.

Asset bodies stay short: read through a resource, call `inference/`, write through a resource,
return a MaterializeResult with metadata.
"""

import hashlib
import resource
import time
from dataclasses import dataclass
from datetime import date, datetime
from pathlib import Path
from typing import Literal, Self

import polars as pl
from dagster import (
    AssetCheckResult,
    AssetCheckSeverity,
    AssetCheckSpec,
    AssetDep,
    AssetExecutionContext,
    AssetKey,
    AssetsDefinition,
    DailyPartitionsDefinition,
    DataVersion,
    Failure,
    MaterializeResult,
    MetadataValue,
    asset,
)
from pydantic import Field, model_validator

from assets.automation import PRODUCTION_MODEL, rescore_after_promotion
from assets.config import AssetConfig
from assets.metadata import STORE_READ_FROM, score_distribution, table_metadata, table_schema
from assets.model import build_production_model, challenger_model_observation, production_model_observation
from assets.partitions import partition_day
from assets.resources import DatabaseResource, ModelStoreResource, RecordSourceResource
from assets.retries import fail_at_once, retry_only_transient_errors
from assets.scoring import (
    DATABASE_POOL,
    BatchScoringConfig,
    daily_database_step,
    model_key,
    records_key,
    records_with_history,
    score_day,
)
from inference.batch import ChunkProgress, PartitionReport, ingest_day
from inference.model import IncompatibleModelError, LoadedModel, TrainingReport
from inference.parity import PARITY_TOLERANCE, ParityReport, check_parity
from inference.records import input_hash_expr
from inference.sources import SourceError
from inference.spec import LoadedSpec
from inference.store import (
    PartitionCounts,
    batch_scores,
    partition_counts,
    record_table,
    stored_partition_dates,
    utc_now,
)
from inference.store import predictions as predictions_table
from inference.training import evaluate_auc, train_from_store
from tandem import modelstore
from tandem.version import code_version

# Dagster code versions: a constant per asset, bumped by hand when that asset's output would change
# for the same inputs (its body, or the inference/ code it calls: features, scoring). Not
# tandem.version.code_version(), the git revision: every commit, a README edit included, would then
# mark every partition stale and make rescore_after_promotion rescore the last week. Result rows
# still record the git revision as their lineage.
TRANSACTIONS_CODE_VERSION = "1"
RISK_MODEL_CODE_VERSION = "1"
PREDICTIONS_CODE_VERSION = "1"

PREDICTIONS_KEY = AssetKey("predictions")


class RiskModelConfig(AssetConfig):
    training_days: int = Field(default=7, ge=2, description="most recent stored days used; the last is held out")
    epochs: int | None = Field(default=None, ge=1, description="unset: the spec's train_epochs")
    max_train_rows: int = Field(default=60_000, ge=1_000)
    seed: int = 7
    force_promote: bool = Field(default=False, description="promote even if not at least as good as production")
    register_as: Literal["production", "challenger"] = Field(
        default="production",
        description="production: promote when at least as good; challenger: set as the challenger, to be shadowed "
        "online, replayed by challenger_predictions and judged by challenger_report before any promotion",
    )

    @model_validator(mode="after")
    def _force_promote_is_for_production(self) -> Self:
        # A challenger is never promoted by this asset: accepted, force_promote was silently ignored.
        if self.force_promote and self.register_as == "challenger":
            raise ValueError("force_promote: true goes with register_as: production (a challenger is never promoted)")
        return self


class PredictionsConfig(BatchScoringConfig):
    reject_rate_warn: float = Field(default=0.02, ge=0, le=1)
    reject_rate_max: float = Field(default=0.10, ge=0, le=1, description="above this the check blocks")
    parity_sample: int = Field(default=64, ge=0, description="rows re-scored through the online code path")
    unseen_share_warn: float = Field(
        default=0.01, ge=0, le=1, description="warn above this share of scored rows with a value outside the vocabulary"
    )

    @model_validator(mode="after")
    def _warn_before_blocking(self) -> Self:
        # reject_rate_bounded passes at or below reject_rate_warn: a warn bound above the blocking one
        # passed a day the blocking bound was set to stop, and path_agreement ran after it.
        if self.reject_rate_warn > self.reject_rate_max:
            raise ValueError(
                f"reject_rate_warn ({self.reject_rate_warn}) is above reject_rate_max ({self.reject_rate_max})"
            )
        return self


def _peak_rss_mb() -> float:
    """VmHWM of this process image; ru_maxrss survives exec, so a step process could report the
    peak of the process that started it (bench/batch_worker.py)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def content_version(ls: LoadedSpec, frame: pl.DataFrame) -> DataVersion:
    """A day's data version: the digest of its records as received, in any order. Re-ingesting the
    same records keeps it (nothing downstream turns stale); a corrected record changes it."""
    digest = hashlib.sha256()
    canonical = frame.select(input_hash_expr(ls).alias("record")).sort("record")
    for chunk in canonical.iter_slices(65_536):
        digest.update("\n".join(chunk["record"].fill_null("").to_list()).encode())
    return DataVersion(digest.hexdigest()[:16])


def _model_for_scoring(context: AssetExecutionContext, ls: LoadedSpec, model_store: ModelStoreResource) -> None:
    """Fails a run that is to score the day when there is no model to score it with, before the
    day is ingested: the run could only fail later, with the stored day already changed. A run
    that trains the model too makes its own."""
    # A run of a whole job has no asset selection of its own: the 02:00 daily_scoring run scores too.
    selected = context.run.asset_selection or context.job_def.asset_layer.selected_asset_keys
    if PREDICTIONS_KEY not in selected or model_key(ls) in selected or model_store.production_tag() is not None:
        return
    raise Failure(
        description=f"{modelstore.missing_production(model_store.model_name)} (nothing ingested)",
        allow_retries=False,
    )


def build_batch_assets(
    ls: LoadedSpec, partitions: DailyPartitionsDefinition, history_length: int, *, rescore_days: int = 7
) -> list[AssetsDefinition]:
    """The batch path's assets over the code location's `partitions` for the spec `ls`:
    `history_length` is the K the model trains with, `rescore_days` how many scored days a
    promotion rescores.

    Built by factories because those three are settings read when the definitions load; each
    asset's body is a module-level function of its own."""
    return [
        records_asset(ls, partitions),
        model_asset(ls, history_length),
        build_production_model(ls),
        predictions_asset(ls, partitions, rescore_days),
    ]


def records_asset(ls: LoadedSpec, partitions: DailyPartitionsDefinition) -> AssetsDefinition:
    return asset(
        name=ls.spec.name,
        **daily_database_step(partitions),
        code_version=TRANSACTIONS_CODE_VERSION,
        metadata={"dagster/column_schema": table_schema(record_table(ls).table)},
        group_name="batch",
        kinds={"polars", "sql"},
        description=f"Source {ls.spec.plural} of one UTC day, stored as received (poison included).",
    )(ingest_records)


def ingest_records(
    context: AssetExecutionContext,
    database: DatabaseResource,
    source: RecordSourceResource,
    model_store: ModelStoreResource,
) -> MaterializeResult:
    """The body of the records asset: the run's day read from the source and stored."""
    day = partition_day(context)
    _model_for_scoring(context, database.spec, model_store)
    try:
        read = source.read(day)
    except SourceError as error:
        # The day's data is wrong (no file, a missing column): a retry reads the same file, so
        # fail this partition alone with the reason. A lost database connection is not caught.
        raise Failure(description=str(error), allow_retries=False) from error
    with retry_only_transient_errors():
        report = ingest_day(database.spec, database.engine, read.frame, day, run_id=context.run.run_id)
    if report.rows_withdrawn:
        context.log.warning(
            f"{report.rows_withdrawn} stored records of {day} are not in this send, or were refused at ingest: "
            "withdrawn, with their batch answers (docs/data.md, 'A re-sent day')"
        )
    return MaterializeResult(
        data_version=content_version(database.spec, read.frame),
        metadata={
            **table_metadata(table_schema(record_table(database.spec).table), report.rows_stored),
            "rows_received": report.rows_received,
            "rows_stored": report.rows_stored,
            "rows_new_or_changed": report.rows_changed,
            # Stored from an earlier send of the day, no longer in this one: deleted (docs/data.md).
            "rows_withdrawn": report.rows_withdrawn,
            "rejected_at_ingest": report.rejected_at_ingest,
            # Rows whose outcome is known (label 0 or 1): the examples training can learn from.
            **({"rows_labelled": report.rows_labelled} if report.rows_labelled is not None else {}),
            "source_kind": read.kind,
            "source_paths": MetadataValue.json(list(read.paths)),
            # The landing sensor compares this with the files now there: equal means ingested.
            **({"source_version": read.version} if read.version is not None else {}),
        },
    )


def model_asset(ls: LoadedSpec, history_length: int) -> AssetsDefinition:
    # A factory for the spec's names and K: the code location's settings, read when definitions load.
    @asset(
        name=ls.spec.model_name,
        deps=[records_key(ls)],
        code_version=RISK_MODEL_CODE_VERSION,
        group_name="model",
        kinds={"pytorch", "bentoml"},
        pool=DATABASE_POOL,
        description="Trains, evaluates and registers a model version; promotes it if at least as good.",
    )
    def train_model(
        context: AssetExecutionContext,
        config: RiskModelConfig,
        database: DatabaseResource,
        model_store: ModelStoreResource,
    ) -> MaterializeResult:
        return train_risk_model(context, config, database, model_store, history_length)

    return train_model


@dataclass(frozen=True)
class _Trained:
    """A version just registered, and production's AUC on its holdout day (None: nothing to beat)."""

    tag: str
    report: TrainingReport
    production: str | None
    production_auc: float | None
    holdout: date


def _train_and_register(
    context: AssetExecutionContext,
    config: RiskModelConfig,
    database: DatabaseResource,
    model_store: ModelStoreResource,
    history_length: int,
) -> _Trained:
    with database.engine.connect() as conn:
        days = stored_partition_dates(database.spec, conn)[-config.training_days :]
    if len(days) < 2:
        raise ValueError(f"need at least two stored days of {database.spec.spec.plural} to train, found {len(days)}")
    first, holdout = days[0], days[-1]
    model, report = train_from_store(
        database.engine,
        database.spec,
        first_day=first,
        holdout_day=holdout,
        config=database.spec.spec.model_config(history_length),
        seed=config.seed,
        epochs=config.epochs,
        max_train_rows=config.max_train_rows,
    )
    tag = modelstore.register(model, report, name=model_store.model_name, code_version=code_version())
    current = model_store.production_tag()
    try:
        current_auc = (
            evaluate_auc(database.engine, database.spec, modelstore.load(current), first_day=first, holdout_day=holdout)
            if current
            else None
        )
    except (IncompatibleModelError, modelstore.SpecMismatch) as error:
        # Production was trained for another vocabulary or spec: this code can neither score with
        # it nor compare against it, so the new version replaces it (else nothing ever could).
        context.log.warning(f"production model not comparable, replacing it: {error}")
        current_auc = None
    return _Trained(tag, report, current, current_auc, holdout)


def train_risk_model(
    context: AssetExecutionContext,
    config: RiskModelConfig,
    database: DatabaseResource,
    model_store: ModelStoreResource,
    history_length: int,
) -> MaterializeResult:
    """The body of the training asset: a new version trained, registered, and promoted, set as the
    challenger or kept out of production."""
    with retry_only_transient_errors():
        trained = _train_and_register(context, config, database, model_store, history_length)
    tag, report, current_auc = trained.tag, trained.report, trained.production_auc
    challenged = config.register_as == "challenger" and trained.production is not None
    promoted = not challenged and (config.force_promote or current_auc is None or report.auc >= current_auc)
    if promoted:
        modelstore.promote(tag)
        # Said at once, so that predictions written after this run record the new version as
        # their input (production_model_observer would only see it on its next tick).
        context.log_event(production_model_observation(tag))
    elif challenged:
        modelstore.challenge(tag)
        context.log_event(challenger_model_observation(tag))
    decision = "promoted" if promoted else "challenger" if challenged else "kept production"
    context.log.info(f"{tag}: AUC {report.auc:.4f} (production {current_auc}); {decision}")
    production = model_store.production_tag() or ""
    return MaterializeResult(
        # What the materialization leaves in production: a run that promotes nothing keeps it.
        data_version=DataVersion(production or "none"),
        metadata={
            "version_tag": tag,
            "auc": report.auc,
            "production_auc_same_holdout": current_auc if current_auc is not None else float("nan"),
            "promoted": promoted,
            "decision": decision,
            "production_tag": production,
            "parameter_count": report.parameter_count,
            "flops_per_item": report.flops_per_item,
            "train_rows": report.train_rows,
            "holdout_day": trained.holdout.isoformat(),
        },
    )


PREDICTIONS_CHECKS = [
    AssetCheckSpec("rows_accounted_for", asset="predictions", description="scored + rejected = input"),
    AssetCheckSpec("scores_in_unit_interval", asset="predictions", description="finite, within [0, 1]"),
    AssetCheckSpec(
        "unseen_vocabulary_share",
        asset="predictions",
        description="share of scored rows with a categorical field's value outside the training "
        "vocabulary (scored through the unknown bucket); a warning that the model wants retraining",
    ),
    AssetCheckSpec(
        "batch_answers_current",
        asset="predictions",
        description="every batch answer is for the stored record's current content",
    ),
    AssetCheckSpec("reject_rate_bounded", asset="predictions", blocking=True),
    AssetCheckSpec(
        "parity_with_online",
        asset="predictions",
        description="a sample re-scored through the online code path agrees within 1e-5",
    ),
]


def predictions_asset(ls: LoadedSpec, partitions: DailyPartitionsDefinition, rescore_days: int) -> AssetsDefinition:
    return asset(
        name="predictions",
        **daily_database_step(partitions),
        deps=[records_with_history(ls), AssetDep(PRODUCTION_MODEL)],
        code_version=PREDICTIONS_CODE_VERSION,
        automation_condition=rescore_after_promotion(rescore_days),
        metadata={"dagster/column_schema": table_schema(predictions_table)},
        group_name="batch",
        kinds={"pytorch", "sql"},
        check_specs=PREDICTIONS_CHECKS,
        description="Batch scores for one day (path=batch); bad rows quarantined in rejected_records.",
    )(score_predictions)


@dataclass(frozen=True)
class _Scored:
    """What a scored day reports: the pipeline's report and, read back from the store, its counts,
    its score distribution and the parity sample."""

    report: PartitionReport
    counts: PartitionCounts
    scores: list[float]
    parity: ParityReport
    cpu_seconds: float
    store_read_from: datetime


def _score_and_count(
    context: AssetExecutionContext,
    config: PredictionsConfig,
    database: DatabaseResource,
    day: date,
    loaded: tuple[LoadedModel, str],
) -> _Scored:
    version = loaded[1]

    def progress(chunk: ChunkProgress) -> None:
        context.log.info(f"chunk {chunk.chunk}: {chunk.rows_done} rows, {chunk.rows_per_second:,.0f} rows/s")

    cpu_started = time.process_time()  # every thread of this process: the pipeline's stages
    store_read_from = utc_now()
    report, predictor = score_day(context, day, database, loaded, config, on_chunk=progress)
    cpu_seconds = time.process_time() - cpu_started
    with database.engine.connect() as conn:
        counts = partition_counts(
            database.spec, conn, partition_date=day, partition_key=context.partition_key, model_version=version
        )
        scores = batch_scores(conn, partition_key=context.partition_key, model_version=version)
    parity = check_parity(
        database.spec, database.engine, predictor, partition_key=context.partition_key, sample_size=config.parity_sample
    )
    return _Scored(report, counts, scores, parity, cpu_seconds, store_read_from)


def score_predictions(
    context: AssetExecutionContext,
    config: PredictionsConfig,
    database: DatabaseResource,
    model_store: ModelStoreResource,
) -> MaterializeResult:
    """The body of `predictions`: the run's day scored by the production model, with its checks."""
    day = partition_day(context)
    with fail_at_once("the production model could not be loaded"):
        loaded = model_store.production()
    started = time.perf_counter()
    with retry_only_transient_errors():
        scored = _score_and_count(context, config, database, day, loaded)
    report, counts = scored.report, scored.counts
    unseen_share = report.scored_with_unseen / report.scored if report.scored else 0.0
    return MaterializeResult(
        metadata={
            **table_metadata(table_schema(predictions_table), counts.scored),
            **score_distribution(scored.scores),
            "rows_in": report.rows_in,
            "scored": report.scored,
            "rejected": report.rejected,
            "rejected_by_reason": MetadataValue.json(dict(report.rejected_by_reason)),
            # Answered online too, and scored again here: both answers are kept (docs/decisions/0002).
            "answered_online": counts.answered_online,
            "unseen_values_by_field": MetadataValue.json(dict(sorted(report.unseen_by_field.items()))),
            "unseen_share": unseen_share,
            "model_version": loaded[1],
            "rows_per_second": round(report.rows_per_second, 1),
            "cpu_ms_per_record": round(scored.cpu_seconds * 1000 / max(report.rows_in, 1), 4),
            "peak_rss_mb": round(_peak_rss_mb(), 1),
            "stage_busy_s": MetadataValue.json(report.stage_seconds),
            "duration_s": round(time.perf_counter() - started, 3),
            "chunks": report.chunks,
            STORE_READ_FROM: MetadataValue.timestamp(scored.store_read_from),
        },
        check_results=_predictions_checks(scored, config, unseen_share),
    )


def _predictions_checks(scored: _Scored, config: PredictionsConfig, unseen_share: float) -> list[AssetCheckResult]:
    report, counts, parity = scored.report, scored.counts, scored.parity
    reject_rate = counts.reject_rate
    # Above the warning bound the check fails as a warning; above the hard bound it blocks.
    rate_severity = AssetCheckSeverity.ERROR if reject_rate > config.reject_rate_max else AssetCheckSeverity.WARN
    return [
        AssetCheckResult(
            check_name="rows_accounted_for",
            passed=counts.scored + counts.rejected == counts.input_rows,
            metadata={
                "input": counts.input_rows,
                "scored": counts.scored,
                "rejected": counts.rejected,
                "answered_online": counts.answered_online,
                "accounting": "online answers are kept beside batch ones, not counted instead of them",
            },
        ),
        AssetCheckResult(
            check_name="scores_in_unit_interval",
            passed=counts.scores_out_of_range == 0,
            metadata={"out_of_range": counts.scores_out_of_range},
        ),
        AssetCheckResult(
            check_name="batch_answers_current",
            passed=counts.stale_answers == 0,
            metadata={"stale_answers": counts.stale_answers},
        ),
        AssetCheckResult(
            check_name="parity_with_online",
            passed=not parity.mismatched,
            metadata={
                "sampled": parity.sampled,
                "max_abs_difference": parity.max_abs_difference,
                "tolerance": PARITY_TOLERANCE,
                "mismatched_records": MetadataValue.json(parity.mismatched[:50]),
            },
        ),
        AssetCheckResult(
            check_name="reject_rate_bounded",
            passed=reject_rate <= config.reject_rate_warn,
            severity=rate_severity,
            metadata={
                "reject_rate": reject_rate,
                "rejected_at_scoring": counts.rejected,
                "rejected_at_ingest": counts.rejected_at_ingest,
                "warn_above": config.reject_rate_warn,
                "block_above": config.reject_rate_max,
            },
        ),
        # Drift, not poison: unseen values are scored, so this warns and never blocks.
        AssetCheckResult(
            check_name="unseen_vocabulary_share",
            passed=unseen_share <= config.unseen_share_warn,
            severity=AssetCheckSeverity.WARN,
            metadata={
                "unseen_share": unseen_share,
                "scored_with_unseen": report.scored_with_unseen,
                "warn_above": config.unseen_share_warn,
                "unseen_values_by_field": MetadataValue.json(dict(sorted(report.unseen_by_field.items()))),
            },
        ),
    ]
