"""The code location follows TANDEM_MODEL_SPEC: a spec without an entity (diabetes, K = 0) gets its
own asset names and runs ingest, training and scoring through Dagster as the reference does."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa
from dagster import AssetKey, AssetsDefinition, DagsterInstance, materialize

from assets.resources import RecordSourceResource
from inference.spec import load_spec
from inference.store import predictions, rejected_records
from orchestration.definitions import build_definitions
from orchestration.settings import OrchestrationSettings
from tests.orchestration.support import batch_resources, run_partition, select_rows

DIABETES = "tandem_specs.diabetes:SPEC"
MODEL_NAME = "progression_model_orchestration_tests"
DAYS = ("2026-11-01", "2026-11-02", "2026-11-03")


@pytest.fixture
def diabetes(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setenv("TANDEM_MODEL_SPEC", DIABETES)
    yield


def settings() -> OrchestrationSettings:
    """The spec's own K (0) when TANDEM_HISTORY_LENGTH is unset."""
    return OrchestrationSettings(partitions_start="2026-11-01")


def test_the_assets_and_jobs_are_named_by_the_spec(diabetes: None) -> None:
    defs = build_definitions(settings())
    keys = {key for asset in defs.assets or [] if isinstance(asset, AssetsDefinition) for key in asset.keys}

    assert {AssetKey("patients"), AssetKey("progression_model"), AssetKey("predictions")} <= keys
    assert not keys & {AssetKey("transactions"), AssetKey("risk_model")}
    daily = defs.resolve_job_def("daily_scoring")
    assert AssetKey("patients") in daily.asset_layer.selected_asset_keys
    assert defs.resolve_job_def("ingest_patients").asset_layer.selected_asset_keys == {AssetKey("patients")}
    assert not any(job.name == "ingest_transactions" for job in defs.resolve_all_job_defs())


def test_a_spec_without_history_is_ingested_trained_and_scored_through_dagster(diabetes: None, tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'diabetes.db'}"
    defs = build_definitions(settings())
    assets = [asset for asset in defs.assets or [] if isinstance(asset, AssetsDefinition)]
    # A landing folder of its own: the session's demo folders hold the reference's days.
    resources = {
        **batch_resources(url, model_name=MODEL_NAME),
        "source": RecordSourceResource(kind="demo", location=str(tmp_path / "landing")),
    }
    with DagsterInstance.ephemeral() as instance:
        for day in DAYS:
            run_partition(assets, resources, instance, partition_key=day, selection=["patients"])
        trained = materialize(
            assets,
            selection=["progression_model"],
            instance=instance,
            resources=resources,
            run_config={"ops": {"progression_model": {"config": {"training_days": 3, "epochs": 5}}}},
        )
        assert trained.success
        scored = run_partition(assets, resources, instance, partition_key=DAYS[-1], selection=["predictions"])

    checks = {result.check_name: result.passed for result in scored.get_asset_check_evaluations()}
    assert checks["rows_accounted_for"], checks
    answered = select_rows(url, sa.select(predictions.c.record_id).where(predictions.c.partition_key == DAYS[-1]))
    refused = select_rows(
        url, sa.select(rejected_records.c.record_id).where(rejected_records.c.partition_key == DAYS[-1])
    )
    stored = select_rows(
        url, sa.text("SELECT patient_id FROM patients WHERE partition_date = :day").bindparams(day=DAYS[-1])
    )
    assert answered and all(str(row["record_id"]).startswith("patient-") for row in answered)
    # Every stored patient of the day is answered or quarantined, none twice.
    assert len(answered) + len(refused) >= len(stored) > 0
    assert load_spec(DIABETES).entity is None


def test_history_for_a_spec_without_an_entity_is_refused_when_the_settings_load(diabetes: None) -> None:
    assert settings().history_length == 0
    with pytest.raises(ValueError, match="has no entity, so K must be 0"):
        OrchestrationSettings(partitions_start="2026-11-01", history_length=4)
