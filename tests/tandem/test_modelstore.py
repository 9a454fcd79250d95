"""Model versions through the BentoML store, and the production pointer's promote/rollback moves.

BENTOML_HOME points at the session's temporary folder (tests/conftest.py); every test uses a model
name of its own, so pointers and versions never leak between tests.
"""

from __future__ import annotations

import dataclasses
import os
import uuid
from pathlib import Path

import bentoml
import numpy as np
import pytest
import torch
from bentoml._internal.configuration.containers import BentoMLContainer
from bentoml.exceptions import NotFound

from inference.features import build_features
from inference.model import LoadedModel, TrainingReport, score_batch
from inference.records import split_valid
from tandem import modelstore
from tandem_specs.transactions.demo import DemoConfig, generate_day
from tests.inference.support import DAY, TINY_MODEL
from tests.reference import REFERENCE
from tests.shared import reference_model


def fresh_name() -> str:
    return f"risk_{uuid.uuid4().hex[:10]}"


def report_for(model: LoadedModel, auc: float = 0.5) -> TrainingReport:
    return TrainingReport(
        auc=auc,
        train_rows=10,
        holdout_rows=5,
        epochs=1,
        parameter_count=model.parameter_count,
        flops_per_item=None,
    )


def register_new(name: str, seed: int, auc: float = 0.5) -> tuple[LoadedModel, str]:
    torch.manual_seed(seed)
    model = reference_model(TINY_MODEL)
    return model, modelstore.register(model, report_for(model, auc), name=name, code_version="test")


def test_register_then_load_gives_bit_identical_outputs() -> None:
    valid, _ = split_valid(REFERENCE, generate_day(DAY, DemoConfig(seed=9, rows_per_day=200, poison_rate=0.0)))
    features = build_features(REFERENCE, valid, valid, TINY_MODEL.history_length)
    name = fresh_name()
    model, tag = register_new(name, seed=1, auc=0.75)
    assert tag.startswith(f"{name}:")

    loaded = modelstore.load(tag)
    assert loaded.config == model.config
    with torch.inference_mode():
        assert torch.equal(model.module(*features.tensors()), loaded.module(*features.tensors()))
    assert np.array_equal(score_batch(model, features), score_batch(loaded, features))

    [version] = modelstore.versions(name)
    assert version.tag == tag
    assert version.metadata["auc"] == 0.75
    assert version.metadata["code_version"] == "test"
    assert version.metadata["parameter_count"] == model.parameter_count


def test_promote_production_tag_and_rollback() -> None:
    name = fresh_name()
    _, first = register_new(name, seed=1)
    _, second = register_new(name, seed=2)
    _, third = register_new(name, seed=3)
    assert modelstore.production_tag(name) is None

    modelstore.promote(first)
    assert modelstore.production_tag(name) == first
    modelstore.promote(second)
    modelstore.promote(second)  # promoting the current version again is a no-op, not a history entry
    modelstore.promote(third)
    assert modelstore.production_tag(name) == third

    assert modelstore.rollback(name) == second
    assert modelstore.production_tag(name) == second
    assert modelstore.rollback(name) == first
    assert modelstore.production_tag(name) == first
    with pytest.raises(LookupError):
        modelstore.rollback(name)
    assert modelstore.production_tag(name) == first

    # Promoting again after rollbacks moves forward from where production now is.
    modelstore.promote(third)
    assert modelstore.rollback(name) == first


def test_rollback_without_history_raises_lookup_error() -> None:
    name = fresh_name()
    with pytest.raises(LookupError):
        modelstore.rollback(name)
    _, only = register_new(name, seed=1)
    modelstore.promote(only)
    with pytest.raises(LookupError):
        modelstore.rollback(name)
    assert modelstore.production_tag(name) == only


def test_load_production() -> None:
    name = fresh_name()
    with pytest.raises(LookupError):
        modelstore.load_production(name)
    model, tag = register_new(name, seed=5)
    modelstore.promote(tag)
    loaded, loaded_tag = modelstore.load_production(name)
    assert loaded_tag == tag
    for key, value in model.module.state_dict().items():
        assert torch.equal(value, loaded.module.state_dict()[key]), key


def test_pointers_are_per_model_name() -> None:
    one, other = fresh_name(), fresh_name()
    _, tag = register_new(one, seed=1)
    modelstore.promote(tag)
    assert modelstore.production_tag(one) == tag
    assert modelstore.production_tag(other) is None


def test_promoting_an_unknown_version_fails_and_keeps_the_pointer() -> None:
    name = fresh_name()
    _, tag = register_new(name, seed=1)
    modelstore.promote(tag)
    with pytest.raises(NotFound):
        modelstore.promote(f"{name}:doesnotexist")
    assert modelstore.production_tag(name) == tag


def test_model_config_reads_a_versions_history_length_without_its_weights() -> None:
    _, tag = register_new(fresh_name(), seed=4)
    assert modelstore.model_config(tag) == dataclasses.asdict(TINY_MODEL)
    assert modelstore.model_config(tag)["history_length"] == 8


def test_the_pointer_lives_in_the_bentoml_home_that_bentoml_itself_resolved() -> None:
    """Pins the one import from bentoml._internal (no public API gives BENTOML_HOME): if BentoML
    moves or renames it, this fails here rather than the pointer landing somewhere else."""
    home = Path(BentoMLContainer.bentoml_home.get())
    assert home == Path(os.environ["BENTOML_HOME"])
    name = fresh_name()
    _, tag = register_new(name, seed=5)
    # The models this store registers live under the same home as the pointer beside them.
    assert Path(bentoml.models.get(tag).path).is_relative_to(home / "models")
    modelstore.promote(tag)
    assert (home / "tandem" / f"{name}.production.json").is_file()
