"""Both paths in the order production runs them: online answers during the day, the nightly batch
run after; batch answers every row anyway, the online answers stay as they were, and
`path_agreement` explains every difference (or warns about the one it cannot)."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import date, timedelta
from pathlib import Path
from typing import Any

import polars as pl
import pytest
from dagster import AssetCheckSeverity, AssetsDefinition, DagsterInstance, ExecuteInProcessResult

from assets.resources import RecordSourceResource
from inference.agreement import Cause
from inference.contract import TorchPredictor
from inference.records import raw_columns, validate
from inference.spec import LoadedSpec
from inference.store import (
    ResultPath,
    StoreHistory,
    make_engine,
    read_partition_rows,
    read_predictions,
    upsert_records,
    utc_now,
)
from orchestration.definitions import build_definitions
from orchestration.settings import OrchestrationSettings
from tests.answers import answer, write_answers
from tests.orchestration.support import (
    DEMO_SEED,
    MODEL_NAME,
    PARTITION,
    batch_resources,
    prediction_rows,
    predictions_config,
    rejection_rows,
    run_partition,
)
from tests.reference import REFERENCE
from tests.shared import register_untrained_spec_model

DAY = date.fromisoformat(PARTITION)
ROWS = 600
ONLINE_ANSWERED = 12


def _resources(url: str) -> dict[str, Any]:
    return batch_resources(url, rows_per_day=ROWS, poison_rate=0.01)


def _checks(result: ExecuteInProcessResult) -> dict[str, Any]:
    return {evaluation.check_name: evaluation for evaluation in result.get_asset_check_evaluations()}


def _metadata(result: ExecuteInProcessResult, asset: str) -> dict[str, Any]:
    (materialization,) = result.asset_materializations_for_node(asset)
    return {key: value.value for key, value in materialization.metadata.items()}


def _online_rows(url: str) -> list[dict[str, Any]]:
    engine = make_engine(url)
    try:
        with engine.connect() as conn:
            return read_predictions(conn, path=ResultPath.ONLINE.value).to_dicts()
    finally:
        engine.dispose()


def _agreement(assets: list[AssetsDefinition], url: str, instance: DagsterInstance) -> ExecuteInProcessResult:
    return run_partition(assets, _resources(url), instance, selection=["path_agreement"])


# ------------------------------------------------------------------ every cause, one unexplained pair
def _disagreeing(batch: dict[str, Any], cause: Cause) -> dict[str, Any]:
    """An online answer to `batch`'s transaction that differs from it for `cause`, crossing 0.5."""
    far = 0.01 if batch["score"] >= 0.5 else 0.99
    base = {"input_hash": batch["input_hash"], "history_hash": batch["history_hash"]}
    changes: dict[str, Any] = {
        Cause.MODEL_CHANGED: {"model_version": "risk_model:retired"},
        Cause.INPUT_CORRECTED: {"input_hash": "the-body-before-its-correction"},
        Cause.DEGRADED: {"degraded": True},
        Cause.HISTORY_CHANGED: {"history_hash": "history-before-a-late-record"},
        Cause.UNEXPLAINED: {},
    }[cause]
    kwargs = {"model_version": batch["model_version"], **base, **changes}
    return answer(batch["record_id"], path="online", score=far, request_id=f"req-{cause}", **kwargs)


def test_path_agreement_names_every_cause_and_warns_about_an_unexplained_pair(
    assets: list[AssetsDefinition], production_tag: str, instance: DagsterInstance, database_url: str
) -> None:
    scored = run_partition(assets, _resources(database_url), instance, run_config=predictions_config(parity_sample=0))
    assert scored.success
    batch = prediction_rows(database_url)
    agree, *explained, skew = batch[:6]
    batch_ids = {row["record_id"] for row in batch}
    rejected_id = next(
        row["record_id"]
        for row in rejection_rows(database_url)
        if row["stage"] == "score" and row["record_id"] and row["record_id"] not in batch_ids
    )
    causes = [Cause.MODEL_CHANGED, Cause.INPUT_CORRECTED, Cause.DEGRADED, Cause.HISTORY_CHANGED]
    engine = make_engine(database_url)
    write_answers(
        engine,
        answer(
            agree["record_id"],
            path="online",
            score=agree["score"] + 1e-7,
            model_version=agree["model_version"],
            input_hash=agree["input_hash"],
            history_hash=agree["history_hash"],
        ),
        *(_disagreeing(row, cause) for row, cause in zip(explained, causes, strict=True)),
        # Batch rejected this one; the online path answered it.
        answer(rejected_id, path="online", score=0.5, model_version=production_tag),
    )

    result = _agreement(assets, database_url, instance)
    assert result.success
    (check,) = _checks(result).values()
    assert (check.check_name, check.passed) == ("disagreement_explained", True)
    report = _metadata(result, "path_agreement")
    assert (report["pairs"], report["online_without_batch"]) == (5, 1)
    assert report["dagster/row_count"] == report["pairs"]
    assert "online_score" in {column.name for column in report["dagster/column_schema"].columns}
    assert report["by_cause"] == {cause.value: 0 if cause is Cause.UNEXPLAINED else 1 for cause in Cause}
    assert (report["decision_threshold"], report["crossed_threshold"]) == (0.5, 4)
    assert report["crossed_threshold_share"] == pytest.approx(4 / 5)
    assert report["abs_difference_p50"] > 1e-5 and report["abs_difference_max"] <= 1.0
    assert "| [0, 1e-05] | 1 | 20.0% |" in report["abs_difference_histogram"]
    assert report["unexplained_records"] == []

    # Same model, record and history, another score: nothing in the lineage explains it.
    write_answers(engine, _disagreeing(skew, Cause.UNEXPLAINED))
    engine.dispose()
    result = _agreement(assets, database_url, instance)
    assert result.success  # a warning, not a failed run
    (check,) = _checks(result).values()
    assert not check.passed
    assert check.severity == AssetCheckSeverity.WARN
    assert check.metadata["unexplained_records"].value == [skew["record_id"]]
    report = _metadata(result, "path_agreement")
    assert report["by_cause"][Cause.UNEXPLAINED.value] == 1
    assert report["unexplained_records"] == [skew["record_id"]]


# ------------------------------------------------------------------ the production order, for each spec
@dataclass(frozen=True)
class SpecBatch:
    """The batch path of one spec over this test's database: its assets, resources and production model."""

    ls: LoadedSpec
    assets: list[AssetsDefinition]
    resources: dict[str, Any]
    version: str


@pytest.fixture
def spec_batch(
    spec: LoadedSpec, assets: list[AssetsDefinition], production_tag: str, database_url: str, tmp_path: Path
) -> SpecBatch:
    """The reference's session assets and model; another spec's own, its demo landing in a folder of
    its own (the session's demo folders hold the reference's days)."""
    if spec is REFERENCE:
        return SpecBatch(spec, assets, _resources(database_url), production_tag)
    name = f"{MODEL_NAME}_{spec.spec.name}"
    source = RecordSourceResource(
        kind="demo", location=str(tmp_path / "landing"), seed=DEMO_SEED, rows_per_day=ROWS, poison_rate=0.01
    )
    built = build_definitions(OrchestrationSettings(partitions_start=DAY - timedelta(days=2)))
    return SpecBatch(
        spec,
        [asset for asset in built.assets or [] if isinstance(asset, AssetsDefinition)],
        {**batch_resources(database_url, model_name=name), "source": source},
        register_untrained_spec_model(spec, name),
    )


def _score_online(batch: SpecBatch, url: str, frame: pl.DataFrame, request: str) -> list[dict[str, Any]]:
    """Each record alone, with history from the store: what the service's scoring step does."""
    model, version = batch.resources["model_store"].production()
    assert version == batch.version
    predictor = TorchPredictor(model=model, model_version=version, spec=batch.ls)
    engine = make_engine(url)
    try:
        rows = []
        for i in range(frame.height):
            (scored,) = predictor.predict(
                frame[i : i + 1].select(raw_columns(batch.ls)), StoreHistory(batch.ls, engine)
            ).to_dicts()
            assert scored["reject_reason"] is None
            rows.append(
                answer(
                    scored["record_id"],
                    path="online",
                    score=scored["score"],
                    model_version=version,
                    input_hash=scored["input_hash"],
                    history_hash=scored["history_hash"],
                    request_id=f"{request}-{i}",
                    produced_at=utc_now(),
                )
            )
        write_answers(engine, *rows)
        return rows
    finally:
        engine.dispose()


def _stored_valid(ls: LoadedSpec, url: str) -> pl.DataFrame:
    engine = make_engine(url)
    try:
        with engine.connect() as conn:
            stored = read_partition_rows(ls, conn, DAY)
    finally:
        engine.dispose()
    columns = raw_columns(ls)
    return validate(ls, stored.select(columns)).filter(pl.col("reject_reason").is_null()).select(columns)


def _changed(ls: LoadedSpec, frame: pl.DataFrame, by: float) -> pl.DataFrame:
    """`frame` with its first numeric moved by `by`: another body of the same records, still valid."""
    numeric = ls.numerics[0].name
    return frame.with_columns(pl.col(numeric) + by)


def test_batch_after_online_answers_every_row_and_keeps_the_online_answers(
    spec_batch: SpecBatch, instance: DagsterInstance, database_url: str
) -> None:
    ls, resources = spec_batch.ls, spec_batch.resources
    assert run_partition(spec_batch.assets, resources, instance, selection=[ls.spec.name]).success

    # During the day: some records scored online, one of them retried with a changed body.
    answered = _stored_valid(ls, database_url).head(ONLINE_ANSWERED)
    _score_online(spec_batch, database_url, answered, "req")
    _score_online(spec_batch, database_url, _changed(ls, answered.head(1), 7.0), "retry")
    online_before = _online_rows(database_url)
    assert len(online_before) == ONLINE_ANSWERED + 1

    def nightly() -> ExecuteInProcessResult:
        """The nightly run: score D, then compare the paths."""
        return run_partition(
            spec_batch.assets,
            resources,
            instance,
            selection=["predictions", "path_agreement"],
            run_config=predictions_config(parity_sample=8),
        )

    result = nightly()
    assert result.success
    checks = _checks(result)
    assert {"rows_accounted_for", "batch_answers_current", "disagreement_explained"} <= checks.keys()
    assert [name for name, check in checks.items() if not check.passed] == []
    accounted = checks["rows_accounted_for"].metadata
    assert accounted["answered_online"].value == ONLINE_ANSWERED
    assert accounted["scored"].value + accounted["rejected"].value == accounted["input"].value

    assert _online_rows(database_url) == online_before
    batch_ids = {row["record_id"] for row in prediction_rows(database_url)}
    assert set(answered[ls.id.name]) <= batch_ids, "batch skipped work the online path answered"

    report = _metadata(result, "path_agreement")
    assert report["pairs"] == ONLINE_ANSWERED + 1
    assert report["by_cause"][Cause.AGREE.value] == ONLINE_ANSWERED  # the same core, the same answer
    assert report["by_cause"][Cause.INPUT_CORRECTED.value] == 1  # the retried body is not what batch scored
    assert report["abs_difference_p90"] <= 1e-5

    # Then a correction of an answered record lands, and the sensors' rescore runs.
    corrected_id = answered[ls.id.name][1]
    engine = make_engine(database_url)
    with engine.begin() as conn:
        corrected = _changed(ls, answered.filter(pl.col(ls.id.name) == corrected_id), 1.0)
        assert upsert_records(ls, conn, validate(ls, corrected), DAY) == 1
    engine.dispose()
    result = nightly()
    assert result.success
    assert [name for name, check in _checks(result).items() if not check.passed] == []
    assert _online_rows(database_url) == online_before
    report = _metadata(result, "path_agreement")
    assert report["by_cause"][Cause.UNEXPLAINED.value] == 0
    assert report["by_cause"][Cause.INPUT_CORRECTED.value] >= 2
