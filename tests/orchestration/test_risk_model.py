"""The risk_model asset trained for real: registered, evaluated, promoted only when at least as good."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import bentoml
import pytest
import torch
from dagster import AssetsDefinition, DagsterInstance, materialize

from inference.model import CONFIG_FILE, WEIGHTS_FILE, IncompatibleModelError
from inference.spec import load_spec
from tandem import modelstore
from tandem_specs.transactions.model import ModelConfig
from tests.orchestration.support import SETTINGS, batch_resources, run_partition
from tests.shared import reference_model, register_untrained_model
from tests.specs.tiny import TinyModel

# A name of its own: these promotions must not touch the production model of the other tests.
MODEL = "risk_model_promotion_test"
DAYS = ("2026-11-01", "2026-11-02", "2026-11-03")
QUICK = {"max_train_rows": 2000, "epochs": 1}
# The embeddings of currency, category, country (the record's and the history's).
VOCABULARY_EMBEDDINGS = (
    "current_embeddings.0.weight",
    "current_embeddings.1.weight",
    "current_embeddings.2.weight",
    "history_embeddings.0.weight",
    "history_embeddings.1.weight",
)


def _train(assets: list[AssetsDefinition], resources: dict[str, Any], instance: DagsterInstance, **config: Any):
    result = materialize(
        assets,
        selection=["risk_model"],
        instance=instance,
        resources=resources,
        run_config={"ops": {"risk_model": {"config": config}}},
    )
    assert result.success
    (materialization,) = result.asset_materializations_for_node("risk_model")
    observed = [
        event.asset_observation_data.asset_observation.data_version
        for event in result.all_events
        if event.event_type_value == "ASSET_OBSERVATION"
    ]
    return {
        **{key: value.value for key, value in materialization.metadata.items()},
        # What Dagster's staleness reads: risk_model's data version, production_model's observations.
        "data_version": materialization.tags["dagster/data_version"],
        "production_model_observed": observed,
    }


@pytest.fixture
def resources(assets: list[AssetsDefinition], instance: DagsterInstance, sqlite_url: str) -> dict[str, Any]:
    """Three stored days (two to learn from, the last held out) and no production model yet."""
    resources = batch_resources(sqlite_url, rows_per_day=1500, model_name=MODEL)
    for key in DAYS:
        run_partition(assets, resources, instance, partition_key=key, selection=["transactions"])
    assert modelstore.production_tag(MODEL) is None
    return resources


def test_risk_model_is_trained_registered_and_promoted_only_per_the_rule(
    assets: list[AssetsDefinition], resources: dict[str, Any], instance: DagsterInstance
) -> None:
    first = _train(assets, resources, instance, **QUICK)

    assert first["version_tag"].startswith(f"{MODEL}:")
    assert 0.0 <= first["auc"] <= 1.0
    default = reference_model(ModelConfig(history_length=SETTINGS.history_length))
    assert first["parameter_count"] == default.parameter_count
    assert 0 < first["train_rows"] <= QUICK["max_train_rows"]
    assert first["holdout_day"] == DAYS[-1]
    assert math.isnan(first["production_auc_same_holdout"])  # nothing in production to compare with
    assert first["promoted"] is True
    assert first["production_tag"] == first["version_tag"] == modelstore.production_tag(MODEL)
    assert first["data_version"] == first["version_tag"]
    assert first["production_model_observed"] == [first["version_tag"]]

    # The same data, seed and config train the same model: equal is "at least as good".
    equal = _train(assets, resources, instance, **QUICK)
    assert equal["version_tag"] != first["version_tag"]
    assert equal["auc"] == equal["production_auc_same_holdout"] == first["auc"]
    assert equal["promoted"] is True
    assert modelstore.production_tag(MODEL) == equal["version_tag"]

    # Another seed happens to learn more from these few steps on this (deterministic) data.
    better = _train(assets, resources, instance, **QUICK, seed=8)
    assert better["auc"] > better["production_auc_same_holdout"], "precondition: seed 8 must train the better model"
    assert better["promoted"] is True
    assert modelstore.production_tag(MODEL) == better["version_tag"]

    worse = _train(assets, resources, instance, **QUICK)
    assert worse["auc"] < worse["production_auc_same_holdout"]
    assert worse["promoted"] is False
    assert worse["production_tag"] == better["version_tag"] == modelstore.production_tag(MODEL)
    assert worse["version_tag"] in {version.tag for version in modelstore.versions(MODEL)}  # registered anyway
    assert worse["data_version"] == better["version_tag"], "nothing promoted: the data version stays"
    assert worse["production_model_observed"] == []

    forced = _train(assets, resources, instance, **QUICK, force_promote=True)
    assert forced["auc"] < forced["production_auc_same_holdout"]
    assert forced["promoted"] is True
    assert forced["production_tag"] == forced["version_tag"] == modelstore.production_tag(MODEL)


def test_force_promote_with_register_as_challenger_is_refused(
    assets: list[AssetsDefinition], instance: DagsterInstance, sqlite_url: str
) -> None:
    # A challenger is never promoted: accepted, force_promote was ignored without a word.
    result = materialize(
        assets,
        selection=["risk_model"],
        instance=instance,
        resources=batch_resources(sqlite_url, model_name=f"{MODEL}_refused"),
        run_config={"ops": {"risk_model": {"config": {**QUICK, "force_promote": True, "register_as": "challenger"}}}},
        raise_on_error=False,
    )

    assert not result.success
    (failure,) = [event for event in result.all_events if event.event_type_value == "STEP_FAILURE"]
    assert failure.step_failure_data.error is not None
    assert "force_promote: true goes with register_as: production" in str(failure.step_failure_data.error.to_string())


def test_a_production_model_of_the_old_vocabulary_is_replaced_not_compared(
    assets: list[AssetsDefinition], instance: DagsterInstance, sqlite_url: str
) -> None:
    """A production version saved before the unknown bucket cannot be loaded by this code: the
    asset must still train and promote a new one, or no model could ever replace it."""
    name = f"{MODEL}_old_vocabulary"
    resources = batch_resources(sqlite_url, rows_per_day=1500, model_name=name)
    for key in DAYS:
        run_partition(assets, resources, instance, partition_key=key, selection=["transactions"])
    old_tag = register_untrained_model(name, config=ModelConfig(history_length=SETTINGS.history_length))
    weights = Path(bentoml.models.get(old_tag).path) / WEIGHTS_FILE
    state = torch.load(weights, weights_only=True)
    # One row fewer per vocabulary embedding: the shapes such a model was saved with.
    torch.save({k: v[:-1] if k.endswith(VOCABULARY_EMBEDDINGS) else v for k, v in state.items()}, weights)
    with pytest.raises(IncompatibleModelError, match="vocabulary"):
        modelstore.load(old_tag)

    trained = _train(assets, resources, instance, **QUICK)
    assert math.isnan(trained["production_auc_same_holdout"])
    assert trained["promoted"] is True
    assert modelstore.production_tag(name) == trained["version_tag"] != old_tag


def test_a_production_model_of_another_spec_is_replaced_not_compared(
    assets: list[AssetsDefinition], instance: DagsterInstance, sqlite_url: str, tmp_path: Path
) -> None:
    """Production trained with another spec (the store outlived a spec change): it cannot be
    scored under this one, so the asset promotes the new version instead of comparing with it."""
    name = f"{MODEL}_other_spec"
    resources = batch_resources(sqlite_url, rows_per_day=1500, model_name=name)
    for key in DAYS:
        run_partition(assets, resources, instance, partition_key=key, selection=["transactions"])
    folder = tmp_path / "tiny"
    folder.mkdir()
    torch.save(TinyModel({"history_length": 2}).state_dict(), folder / WEIGHTS_FILE)
    (folder / CONFIG_FILE).write_text(json.dumps({"history_length": 2}))
    tiny = load_spec("tests.specs.tiny:SPEC")
    foreign = modelstore.register_dir(folder, name=name, code_version="test", spec=tiny)
    modelstore.promote(foreign, tiny)
    with pytest.raises(modelstore.SpecMismatch):
        modelstore.load(foreign)

    trained = _train(assets, resources, instance, **QUICK)
    assert math.isnan(trained["production_auc_same_holdout"])
    assert trained["promoted"] is True
    assert modelstore.production_tag(name) == trained["version_tag"] != foreign
