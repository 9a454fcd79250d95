"""The risk model: save/load is bit-exact, training is deterministic, the AUC helper is right."""

from __future__ import annotations

import dataclasses
import functools
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from inference.features import FeatureBatch, build_features
from inference.model import (
    WEIGHTS_FILE,
    IncompatibleModelError,
    LoadedModel,
    auc,
    fit,
    load_model,
    save_model,
    score_batch,
)
from inference.records import split_valid
from inference.spec import load_spec
from tandem_specs.transactions.demo import DemoConfig, generate_day
from tandem_specs.transactions.model import ModelConfig
from tests.inference.support import DAY, TINY_MODEL
from tests.reference import REFERENCE
from tests.shared import reference_model

pytestmark = pytest.mark.usefixtures("torch_single_thread")


@functools.cache
def labelled_features(history_length: int) -> tuple[FeatureBatch, np.ndarray]:
    valid, _ = split_valid(REFERENCE, generate_day(DAY, DemoConfig(seed=4, rows_per_day=400, poison_rate=0.0)))
    labels = valid["label_fraud"].to_numpy().astype(np.float32)
    return build_features(load_spec(), valid, valid, history_length), labels


def model_outputs(model: LoadedModel, features: FeatureBatch) -> torch.Tensor:
    with torch.inference_mode():
        return model.module(*features.tensors())


def assert_same_state(left: LoadedModel, right: LoadedModel) -> None:
    a, b = left.module.state_dict(), right.module.state_dict()
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


def weights_differ(left: LoadedModel, right: LoadedModel) -> bool:
    a, b = left.module.state_dict(), right.module.state_dict()
    return any(not torch.equal(a[name], b[name]) for name in a)


def test_save_then_load_gives_bit_identical_outputs(tmp_path: Path) -> None:
    features, _ = labelled_features(TINY_MODEL.history_length)
    torch.manual_seed(0)
    model = reference_model(TINY_MODEL)
    save_model(model, tmp_path / "saved")
    loaded = load_model(tmp_path / "saved", load_spec())

    assert loaded.config == model.config and loaded.history_length == TINY_MODEL.history_length
    assert not loaded.module.training
    assert_same_state(model, loaded)
    assert torch.equal(model_outputs(model, features), model_outputs(loaded, features))
    assert np.array_equal(score_batch(model, features), score_batch(loaded, features))


def train_once(seed: int) -> tuple[LoadedModel, float]:
    features, labels = labelled_features(TINY_MODEL.history_length)
    split = 300
    model, report = fit(
        load_spec(),
        features.slice(0, split),
        labels[:split],
        features.slice(split, len(features)),
        labels[split:],
        config=dataclasses.asdict(TINY_MODEL),
        seed=seed,
        epochs=2,
        batch_size=64,
    )
    assert report.train_rows == split
    assert report.holdout_rows == len(features) - split
    assert report.parameter_count == model.parameter_count
    return model, report.auc


def test_training_is_deterministic_for_a_fixed_seed() -> None:
    first, first_auc = train_once(seed=3)
    second, second_auc = train_once(seed=3)
    assert_same_state(first, second)
    assert first_auc == second_auc or (math.isnan(first_auc) and math.isnan(second_auc))

    other, _ = train_once(seed=4)
    assert weights_differ(first, other)
    torch.manual_seed(3)
    assert weights_differ(first, reference_model(TINY_MODEL)), "training left the initial weights untouched"


def test_scores_are_probabilities() -> None:
    features, _ = labelled_features(TINY_MODEL.history_length)
    torch.manual_seed(1)
    scores = score_batch(reference_model(TINY_MODEL), features)
    assert scores.dtype == np.float64
    assert scores.shape == (len(features),)
    assert ((scores > 0) & (scores < 1)).all()


def test_auc_helper_sanity() -> None:
    labels = np.array([0, 0, 1, 0, 1, 1])
    perfect = np.array([0.1, 0.2, 0.8, 0.3, 0.9, 0.7])
    assert auc(perfect, labels) == 1.0
    assert auc(-perfect, labels) == 0.0
    assert auc(np.full(labels.size, 0.5), labels) == 0.5
    # One positive below one negative out of 3 x 3 pairs: 8/9.
    assert auc(np.array([0.1, 0.2, 0.8, 0.75, 0.9, 0.7]), labels) == pytest.approx(8 / 9)
    assert math.isnan(auc(np.array([0.1, 0.2]), np.array([1, 1])))
    assert math.isnan(auc(np.array([0.1, 0.2]), np.array([0, 0])))


def test_default_model_has_at_least_a_million_parameters() -> None:
    model = reference_model(ModelConfig())
    assert model.parameter_count >= 1_000_000
    # Every dense weight costs two FLOPs per item (more in the history encoder): cost follows size.
    assert model.parameter_count < model.module.flops_per_item()  # type: ignore[operator]


def test_a_model_saved_before_the_unknown_bucket_fails_to_load_in_one_line(tmp_path: Path) -> None:
    """Models stored before the vocabularies gained an unknown bucket have one embedding row fewer
    per field: loading one must say so, not load partly or dump torch's size-mismatch list."""
    torch.manual_seed(0)
    save_model(reference_model(TINY_MODEL), tmp_path / "old")
    state = torch.load(tmp_path / "old" / WEIGHTS_FILE, weights_only=True)
    old = {
        name: (tensor[:-1] if "embeddings" in name and not name.endswith(("3.weight", "4.weight")) else tensor)
        for name, tensor in state.items()
    }
    torch.save(old, tmp_path / "old" / WEIGHTS_FILE)

    with pytest.raises(IncompatibleModelError) as raised:
        load_model(tmp_path / "old", load_spec())
    message = str(raised.value)
    assert "\n" not in message
    assert "vocabulary" in message
    assert "current_embeddings.0.weight has 8 rows, this code expects 9" in message
    assert "retrain" in message


def test_a_model_of_another_layout_fails_to_load_naming_the_tensor(tmp_path: Path) -> None:
    torch.manual_seed(0)
    save_model(reference_model(TINY_MODEL), tmp_path / "odd")
    state = torch.load(tmp_path / "odd" / WEIGHTS_FILE, weights_only=True)
    torch.save({**state, "head.0.bias": state["head.0.bias"][:-1]}, tmp_path / "odd" / WEIGHTS_FILE)
    with pytest.raises(IncompatibleModelError, match=r"head\.0\.bias"):
        load_model(tmp_path / "odd", load_spec())
    torch.save({k: v for k, v in state.items() if k != "head.0.bias"}, tmp_path / "odd" / WEIGHTS_FILE)
    with pytest.raises(IncompatibleModelError, match="missing"):
        load_model(tmp_path / "odd", load_spec())
