"""transactions + predictions materialized in-process, on SQLite and on PostgreSQL."""

from __future__ import annotations

import uuid
from collections import Counter
from datetime import date
from typing import Any

import polars as pl
import pytest
from dagster import AssetCheckSeverity, AssetsDefinition, DagsterInstance, ExecuteInProcessResult

from assets.resources import ModelStoreResource
from inference.demo import demo_day
from inference.features import build_features
from inference.migrate import upgrade
from inference.model import score_batch
from inference.records import split_valid
from inference.spec import load_spec
from inference.store import RejectStage, ResultPath, make_engine, predictions, read_partition_rows
from tandem import modelstore
from tandem_specs.transactions.demo import EXPECTED_REASON, PoisonKind
from tandem_specs.transactions.model import ModelConfig
from tests.orchestration.support import (
    PARTITION,
    REJECTION_BOOKKEEPING,
    SETTINGS,
    batch_resources,
    prediction_rows,
    predictions_config,
    rejection_rows,
    run_partition,
)
from tests.reference import COUNTRIES, CURRENCIES, MERCHANT_CATEGORIES, RAW_COLUMNS, RECORDS, REFERENCE
from tests.shared import register_untrained_model

CHECKS = {
    "rows_accounted_for",
    "scores_in_unit_interval",
    "batch_answers_current",
    "reject_rate_bounded",
    "unseen_vocabulary_share",
}
RUN_METADATA = {
    "rows_in",
    "scored",
    "rejected",
    "model_version",
    "rows_per_second",
    "cpu_ms_per_record",
    "peak_rss_mb",
    "duration_s",
}


def _metadata(result: ExecuteInProcessResult, asset: str) -> dict[str, Any]:
    (materialization,) = result.asset_materializations_for_node(asset)
    return {key: value.value for key, value in materialization.metadata.items()}


def test_partition_materializes_and_every_check_passes(
    assets: list[AssetsDefinition], production_tag: str, instance: DagsterInstance, database_url: str
) -> None:
    # Production config, except a smaller parity sample (each sampled row is one online request).
    result = run_partition(
        assets,
        batch_resources(database_url, rows_per_day=2000),
        instance,
        run_config=predictions_config(parity_sample=16),
    )

    assert result.success
    evaluations = {evaluation.check_name: evaluation for evaluation in result.get_asset_check_evaluations()}
    assert set(evaluations) >= CHECKS
    assert {name for name, evaluation in evaluations.items() if not evaluation.passed} == set()

    ingested = _metadata(result, "transactions")
    scored = _metadata(result, "predictions")
    assert scored.keys() >= RUN_METADATA
    assert scored["model_version"] == production_tag
    assert scored["rows_in"] == ingested["rows_stored"]
    assert scored["scored"] + scored["rejected"] == scored["rows_in"]
    assert scored["scored"] > 0
    for measured in ("rows_per_second", "cpu_ms_per_record", "peak_rss_mb", "duration_s"):
        assert scored[measured] > 0, measured
    assert len(prediction_rows(database_url)) == scored["scored"]

    # Dagster's standard metadata: the partition's rows, the columns of the table written.
    assert scored["dagster/row_count"] == scored["scored"]
    assert [column.name for column in scored["dagster/column_schema"].columns] == list(predictions.columns.keys())
    assert ingested["dagster/row_count"] == ingested["rows_stored"]
    assert [column.name for column in ingested["dagster/column_schema"].columns] == list(RECORDS.columns.keys())
    # The score distribution the UI shows: deciles as a table, a histogram, p50/p90/p99 it plots.
    deciles = [record.data["score"] for record in scored["score_deciles"].records]
    assert [record.data["quantile"] for record in scored["score_deciles"].records][::5] == ["min", "p50", "max"]
    assert deciles == sorted(deciles) and deciles[0] >= 0 and deciles[-1] <= 1
    assert scored["score_p50"] == pytest.approx(deciles[5])
    histogram = scored["score_histogram"].splitlines()[2:]
    assert len(histogram) == 10 and sum(int(line.split("|")[2]) for line in histogram) == scored["scored"]
    assert sum(scored["rejected_by_reason"].values()) == scored["rejected"]


def test_poison_rows_are_quarantined_and_no_good_row_is_lost(
    assets: list[AssetsDefinition], production_tag: str, instance: DagsterInstance, database_url: str
) -> None:
    resources = batch_resources(database_url, rows_per_day=3000, poison_rate=0.01)
    # The generator's own frame: it knows which rows it poisoned (the landing CSV does not say).
    source = demo_day(REFERENCE, date.fromisoformat(PARTITION), resources["source"].demo_settings())
    poison = source.filter(pl.col("poison_kind").is_not_null())
    assert set(poison["poison_kind"]) == {kind.value for kind in PoisonKind}, "every kind of poison is exercised"
    duplicates = poison.filter(pl.col("poison_kind") == PoisonKind.DUPLICATE_ID.value)
    invalid = poison.filter(pl.col("poison_kind") != PoisonKind.DUPLICATE_ID.value)

    result = run_partition(assets, resources, instance, run_config=predictions_config(parity_sample=8))

    assert result.success
    rejected = rejection_rows(database_url)
    assert {(r["path"], r["resolved"]) for r in rejected} == {(ResultPath.BATCH.value, False)}
    at_ingest = sorted((r["record_id"], r["reason"]) for r in rejected if r["stage"] == RejectStage.INGEST)
    at_score = sorted((r["record_id"], r["reason"]) for r in rejected if r["stage"] == RejectStage.SCORE)
    assert len(at_ingest) + len(at_score) == len(rejected)
    assert at_ingest == sorted((tid, EXPECTED_REASON[PoisonKind.DUPLICATE_ID]) for tid in duplicates["transaction_id"])
    assert at_score == sorted(
        (tid, EXPECTED_REASON[PoisonKind(kind)])
        for tid, kind in invalid.select("transaction_id", "poison_kind").iter_rows()
    )

    predicted = prediction_rows(database_url)
    good_ids = source.filter(pl.col("poison_kind").is_null())["transaction_id"].to_list()
    assert sorted(row["record_id"] for row in predicted) == sorted(good_ids)
    assert {row["model_version"] for row in predicted} == {production_tag}

    ingested, scored = _metadata(result, "transactions"), _metadata(result, "predictions")
    assert ingested["rejected_at_ingest"] == duplicates.height
    assert ingested["rows_labelled"] == ingested["rows_stored"], "every demo record's outcome is known"
    assert scored["rejected"] == invalid.height
    assert scored["rejected_by_reason"] == dict(Counter(reason for _, reason in at_score))
    assert all(evaluation.passed for evaluation in result.get_asset_check_evaluations())


def test_materializing_a_partition_three_times_changes_nothing(
    assets: list[AssetsDefinition], production_tag: str, instance: DagsterInstance, database_url: str
) -> None:
    resources = batch_resources(database_url, rows_per_day=1000, poison_rate=0.02)
    snapshots = []
    for _ in range(3):
        # The parity check only reads; skipping it keeps three runs cheap.
        assert run_partition(assets, resources, instance, run_config=predictions_config(parity_sample=0)).success
        snapshots.append((prediction_rows(database_url), rejection_rows(database_url, exclude=REJECTION_BOOKKEEPING)))

    first_predictions, first_rejections = snapshots[0]
    assert first_predictions and first_rejections
    # Everything, lineage included: a rerun of unchanged input is a no-op, not a rewrite.
    assert snapshots[1] == snapshots[0]
    assert snapshots[2] == snapshots[0]
    assert {row["seen_count"] for row in rejection_rows(database_url)} == {3}


def test_unseen_vocabulary_is_reported_and_warned_about_without_blocking(
    assets: list[AssetsDefinition], production_tag: str, instance: DagsterInstance, database_url: str
) -> None:
    resources = batch_resources(database_url, rows_per_day=2000)
    source = demo_day(REFERENCE, date.fromisoformat(PARTITION), resources["source"].demo_settings())
    clean = source.filter(pl.col("poison_kind").is_null())
    vocabularies = {"country": COUNTRIES, "currency": CURRENCIES, "merchant_category": MERCHANT_CATEGORIES}
    expected = {name: clean.filter(~pl.col(name).is_in(list(known))).height for name, known in vocabularies.items()}
    assert all(count > 0 for count in expected.values()), "the demo day drifts in every field"

    # A bound below the demo's ~0.2 % drift: the check fails as a warning, the run still succeeds.
    result = run_partition(
        assets, resources, instance, run_config=predictions_config(parity_sample=0, unseen_share_warn=0.001)
    )

    assert result.success
    scored = _metadata(result, "predictions")
    assert scored["unseen_values_by_field"] == expected
    flagged = [row for row in prediction_rows(database_url) if row["unseen_fields"] is not None]
    assert len(flagged) == sum(expected.values())  # one unseen field per drifted demo row
    assert scored["unseen_share"] == len(flagged) / scored["scored"]
    evaluations = {evaluation.check_name: evaluation for evaluation in result.get_asset_check_evaluations()}
    unseen = evaluations["unseen_vocabulary_share"]
    assert not unseen.passed
    assert unseen.severity == AssetCheckSeverity.WARN
    assert unseen.metadata["warn_above"].value == 0.001
    # Only that check failed: drift is not poison.
    assert {name for name, evaluation in evaluations.items() if not evaluation.passed} == {"unseen_vocabulary_share"}


def test_a_warn_bound_above_the_blocking_bound_is_refused_at_once(
    assets: list[AssetsDefinition], instance: DagsterInstance, sqlite_url: str
) -> None:
    # Accepted, reject_rate_bounded passed any day at or below the warn bound: 27 % of a day
    # rejected with reject_rate_max 0.05 passed, and path_agreement ran after it.
    result = run_partition(
        assets,
        batch_resources(sqlite_url),
        instance,
        selection=["predictions"],
        run_config=predictions_config(reject_rate_warn=0.9, reject_rate_max=0.05),
        raise_on_error=False,
    )

    assert not result.success
    (failure,) = [event for event in result.all_events if event.event_type_value == "STEP_FAILURE"]
    assert failure.step_failure_data.user_failure_data is not None
    assert "reject_rate_warn (0.9) is above reject_rate_max (0.05)" in str(
        failure.step_failure_data.user_failure_data.description
    )
    # A config error is not transient: the step's RetryPolicy must not run it again.
    assert not [event for event in result.all_events if event.event_type_value == "STEP_UP_FOR_RETRY"]


def test_a_model_trained_with_k_8_is_scored_with_8_whatever_the_setting_says(
    assets: list[AssetsDefinition], instance: DagsterInstance, sqlite_url: str
) -> None:
    assert SETTINGS.history_length == 16, "the code location's setting, which must not win"
    name = f"risk_model_k8_{uuid.uuid4().hex[:8]}"
    tag = register_untrained_model(name, config=ModelConfig(history_length=8))

    result = run_partition(
        assets,
        batch_resources(sqlite_url, rows_per_day=2000, model_name=name),
        instance,
        run_config=predictions_config(parity_sample=8),
    )

    assert result.success
    stored = {row["record_id"]: row["score"] for row in prediction_rows(sqlite_url)}
    engine = make_engine(sqlite_url)
    try:
        with engine.connect() as conn:
            valid, _ = split_valid(
                REFERENCE, read_partition_rows(REFERENCE, conn, date.fromisoformat(PARTITION)).select(RAW_COLUMNS)
            )
    finally:
        engine.dispose()
    model = modelstore.load(tag)

    def scores_with(k: int) -> dict[str, float]:
        features = build_features(load_spec(), valid, valid, k)
        return dict(zip(features.record_ids, score_batch(model, features).tolist(), strict=True))

    with_8, with_16 = scores_with(8), scores_with(16)
    assert stored.keys() == with_8.keys()
    assert max(abs(stored[t] - with_8[t]) for t in stored) < 1e-6
    assert max(abs(with_16[t] - with_8[t]) for t in stored) > 1e-4, "K changes scores here, so the test can fail"
    # What the late-records sensor reads for the downstream-partition rule, without loading weights.
    assert ModelStoreResource(model_name=name).history_length(tag) == 8


def test_a_run_that_would_score_without_a_model_fails_before_ingesting(
    assets: list[AssetsDefinition], instance: DagsterInstance, sqlite_url: str
) -> None:
    # It ingested the day, then failed scoring it: the stored day had changed for a run that could
    # only fail.
    name = f"never_registered_{uuid.uuid4().hex[:8]}"
    resources = batch_resources(sqlite_url, rows_per_day=200, model_name=name)

    result = run_partition(assets, resources, instance, raise_on_error=False)

    assert not result.success
    (failure,) = [event for event in result.all_events if event.is_step_failure]
    assert failure.step_key == "transactions"
    description = str(failure.step_failure_data.user_failure_data.description)
    assert description.startswith(f"no production version of {name!r} in the model store at ")
    assert description.endswith("(nothing ingested)")
    engine = make_engine(sqlite_url)
    upgrade(engine, REFERENCE)  # the failed run may not have touched the database at all
    with engine.connect() as conn:
        assert read_partition_rows(REFERENCE, conn, date.fromisoformat(PARTITION)).height == 0
    engine.dispose()
