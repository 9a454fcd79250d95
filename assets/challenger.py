"""The challenger path in the asset graph: `challenger_predictions` replays stored days with the
challenger through the batch path, and `challenger_report` compares it with the champion on the same
transactions. The report's checks are the gate `tandem models promote --from-challenger` reads
(through the verdict each materialization records in `challenger_reports`).

Nothing here touches `predictions`: the challenger's answers live in `challenger_predictions`, so
no production read (replays, lineage's current answer, path_agreement) can pick one up.
"""

# No `from __future__ import annotations`: Dagster reads the Config class from the asset
# function's annotations (see assets/agreement.py).
import time
from dataclasses import dataclass
from datetime import date, timedelta
from typing import Any

import polars as pl
from dagster import (
    AssetCheckResult,
    AssetCheckSeverity,
    AssetCheckSpec,
    AssetDep,
    AssetExecutionContext,
    AssetsDefinition,
    AssetSpec,
    DailyPartitionsDefinition,
    Failure,
    MaterializeResult,
    MetadataValue,
    asset,
)
from pydantic import Field
from sqlalchemy import Connection

from assets.automation import CHALLENGER_MODEL, PRODUCTION_MODEL, SHADOW_PREDICTIONS
from assets.config import AssetConfig
from assets.metadata import frame_schema, table_metadata, table_schema
from assets.model import build_challenger_model
from assets.partitions import partition_day
from assets.resources import DatabaseResource, ModelStoreResource
from assets.retries import TRANSIENT_RETRY, fail_at_once, retry_only_transient_errors
from assets.scoring import (
    DATABASE_POOL,
    BatchScoringConfig,
    daily_database_step,
    records_with_history,
    score_day,
)
from inference.challenger import BLOCKING_CHECKS, Comparison, PromotionGate, compare
from inference.spec import LoadedSpec
from inference.store import (
    COMPARISON_SCHEMA,
    challenger_predictions,
    champion_challenger_pairs,
    latest_replayed_day,
    online_latencies,
    record_challenger_report,
    utc_now,
)

# Bumped by hand when the output would change for the same inputs (see assets/batch.py).
CHALLENGER_PREDICTIONS_CODE_VERSION = "1"
CHALLENGER_REPORT_CODE_VERSION = "1"

_CHECK_DESCRIPTIONS = {
    "enough_labelled_evidence": "enough labelled pairs, and frauds among them, to judge the challenger",
    "challenger_auc_not_worse": "challenger AUC at least the champion's minus TANDEM_CHALLENGER_AUC_MARGIN",
    "challenger_precision_not_worse": "challenger precision at the alert rate at least the champion's minus "
    "TANDEM_CHALLENGER_PRECISION_MARGIN",
}


class ChallengerPredictionsConfig(BatchScoringConfig):
    """The same knobs as `predictions`: a replay costs what the production run costs."""


class ChallengerReportConfig(AssetConfig):
    days: int = Field(default=7, ge=1, le=366, description="replayed days compared, ending at the latest one")
    shadow_window_hours: float = Field(
        default=24.0, gt=0, description="online answers whose shadow cost is reported, ending now"
    )


def _report_markdown(comparison: Comparison) -> str:
    lines = ["| check | verdict |", "| --- | --- |"]
    for name in BLOCKING_CHECKS:
        verdict = comparison.failures.get(name)
        said = f"FAILS: {verdict}" if verdict else f"passes: {comparison.passed_checks.get(name, '')}"
        lines.append(f"| {name} | {said.replace('|', '/')} |")
    return "\n".join(lines)


def _plotted(metrics: dict[str, Any]) -> dict[str, float | int]:
    """Numbers as float metadata (the UI plots each across materializations); nothing to say is NaN."""
    return {
        name: float("nan") if value is None else value
        for name, value in metrics.items()
        if value is None or isinstance(value, int | float)
    }


def build_challenger_assets(
    ls: LoadedSpec, partitions: DailyPartitionsDefinition
) -> list[AssetsDefinition | AssetSpec]:
    return [
        build_challenger_model(ls),
        challenger_predictions_asset(ls, partitions),
        shadow_predictions,
        challenger_report,
    ]


shadow_predictions = AssetSpec(
    SHADOW_PREDICTIONS,
    deps=[CHALLENGER_MODEL],
    group_name="challenger",
    kinds={"bentoml"},
    description="The challenger's answers to a sample of admitted online requests (challenger_predictions, "
    "path=shadow), scored by the BentoML service off the critical path; never returned to a client.",
)


def challenger_predictions_asset(ls: LoadedSpec, partitions: DailyPartitionsDefinition) -> AssetsDefinition:
    return asset(
        name="challenger_predictions",
        **daily_database_step(partitions),
        deps=[records_with_history(ls), AssetDep(CHALLENGER_MODEL)],
        code_version=CHALLENGER_PREDICTIONS_CODE_VERSION,
        metadata={"dagster/column_schema": table_schema(challenger_predictions)},
        group_name="challenger",
        kinds={"pytorch", "sql"},
        description="One stored day scored by the challenger through the batch path (challenger_predictions, "
        "path=batch): a backfill over the last N days is a labelled backtest. Production answers are untouched.",
    )(replay_with_challenger)


def replay_with_challenger(
    context: AssetExecutionContext,
    config: ChallengerPredictionsConfig,
    database: DatabaseResource,
    model_store: ModelStoreResource,
) -> MaterializeResult:
    """The body of `challenger_predictions`: the run's day scored by the challenger."""
    day = partition_day(context)
    with fail_at_once("the challenger could not be loaded"):
        loaded = model_store.challenger()
    version = loaded[1]
    with retry_only_transient_errors():
        report, _ = score_day(context, day, database, loaded, config, as_challenger=True)
    context.log.info(f"{version}: {report.scored} scored, {report.rejected} rejected on {day}")
    return MaterializeResult(
        metadata={
            **table_metadata(table_schema(challenger_predictions), report.scored),
            "model_version": version,
            "rows_in": report.rows_in,
            "scored": report.scored,
            "rejected": report.rejected,
            "rows_per_second": round(report.rows_per_second),
        }
    )


@dataclass(frozen=True)
class _Compared:
    """The champion and the challenger compared on the replayed days `first_day` .. `last_day`."""

    comparison: Comparison
    pairs: pl.DataFrame
    first_day: date
    last_day: date


def _compare_replayed_days(
    ls: LoadedSpec,
    conn: Connection,
    config: ChallengerReportConfig,
    gate: PromotionGate,
    champion: str,
    challenger: str,
    same_history_length: bool,
) -> _Compared:
    last_day = latest_replayed_day(conn, challenger)
    if last_day is None:
        raise Failure(
            description=f"challenger_predictions has replayed no day with {challenger}: backfill it over "
            "the labelled days first",
            allow_retries=False,
        )
    first_day = last_day - timedelta(days=config.days - 1)
    pairs = champion_challenger_pairs(
        ls,
        conn,
        champion=champion,
        challenger=challenger,
        first_day=first_day,
        last_day=last_day,
        same_history_length=same_history_length,
    )
    since = utc_now() - timedelta(hours=config.shadow_window_hours)
    latencies = online_latencies(conn, champion=champion, challenger=challenger, since=since)
    return _Compared(compare(pairs, latencies, gate), pairs, first_day, last_day)


@asset(
    deps=["challenger_predictions", "predictions", SHADOW_PREDICTIONS, CHALLENGER_MODEL, PRODUCTION_MODEL],
    code_version=CHALLENGER_REPORT_CODE_VERSION,
    metadata={"dagster/column_schema": frame_schema(COMPARISON_SCHEMA)},
    retry_policy=TRANSIENT_RETRY,
    pool=DATABASE_POOL,
    group_name="challenger",
    kinds={"sql"},
    # They gate promotion (`tandem models promote --from-challenger` reads the verdict), not
    # downstream assets: nothing reads the report, and a run that reports a worse challenger
    # did its job, so it succeeds with the checks failed (severity ERROR) rather than fails.
    check_specs=[
        AssetCheckSpec(name, asset="challenger_report", description=description)
        for name, description in _CHECK_DESCRIPTIONS.items()
    ],
    description="Champion against challenger on the same replayed transactions: score agreement, decision "
    "flips, AUC and precision at the alert rate on labelled days, and what shadowing cost. Its checks gate "
    "`tandem models promote --from-challenger`.",
)
def challenger_report(
    context: AssetExecutionContext,
    config: ChallengerReportConfig,
    database: DatabaseResource,
    model_store: ModelStoreResource,
) -> MaterializeResult:
    champion, challenger = model_store.production_tag(), model_store.challenger_tag()
    if champion is None or challenger is None:
        raise Failure(
            description=f"nothing to compare: production {champion}, challenger {challenger} "
            "(`tandem models challenge TAG` sets a challenger)",
            allow_retries=False,
        )
    gate = PromotionGate()
    # Versions of one K read the same history records, so their history digests compare.
    same_history_length = model_store.history_length(champion) == model_store.history_length(challenger)
    started = time.perf_counter()
    with retry_only_transient_errors(), database.engine.connect() as conn:
        compared = _compare_replayed_days(database.spec, conn, config, gate, champion, challenger, same_history_length)
    comparison, window = compared.comparison, f"{compared.first_day} .. {compared.last_day}"
    metrics = {
        **comparison.metrics,
        "first_day": compared.first_day.isoformat(),
        "last_day": compared.last_day.isoformat(),
        "champion": champion,
        "challenger": challenger,
    }
    with retry_only_transient_errors(), database.engine.begin() as conn:
        report_id = record_challenger_report(
            conn,
            champion=champion,
            challenger=challenger,
            created_at=utc_now(),
            run_id=context.run.run_id,
            failures=comparison.failures,
            metrics=metrics,
        )
    verdict = "may be promoted" if comparison.passed else "blocked: " + "; ".join(comparison.failures)
    context.log.info(f"challenger {challenger} against {champion}: {verdict}")
    return MaterializeResult(
        metadata={
            **table_metadata(frame_schema(COMPARISON_SCHEMA), compared.pairs.height),
            **_plotted(comparison.metrics),
            "champion": champion,
            "challenger": challenger,
            "window": window,
            "verdict": MetadataValue.md(_report_markdown(comparison)),
            "promotable": comparison.passed,
            "report_id": MetadataValue.text(str(report_id)),  # an id: not a number to plot
            "seconds": round(time.perf_counter() - started, 3),
        },
        check_results=[
            AssetCheckResult(
                check_name=name,
                passed=name not in comparison.failures,
                severity=AssetCheckSeverity.ERROR,
                description=comparison.failures.get(name) or comparison.passed_checks.get(name),
                metadata={"champion": champion, "challenger": challenger, "report_id": str(report_id)},
            )
            for name in BLOCKING_CHECKS
        ],
    )
