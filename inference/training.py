"""Training data from the store: features through the same pipeline scoring uses."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from datetime import date, timedelta
from typing import Any

import numpy as np
from sqlalchemy.engine import Engine

from inference.features import build_features
from inference.model import LoadedModel, TrainingReport, auc, fit, score_batch
from inference.spec import LoadedSpec
from inference.store import valid_rows_between


def _timeline_order(spec: LoadedSpec) -> list[str]:
    entity = [spec.entity.name] if spec.entity else []
    return [*entity, "event_ts", spec.id.name]


def train_from_store(
    engine: Engine,
    spec: LoadedSpec,
    *,
    first_day: date,
    holdout_day: date,
    config: Mapping[str, Any],
    seed: int,
    epochs: int | None = None,
    max_train_rows: int = 60_000,
) -> tuple[LoadedModel, TrainingReport]:
    """Train on valid rows of [first_day, holdout_day), evaluate AUC on holdout_day.

    Large training sets are subsampled deterministically (every positive kept, negatives thinned),
    so training time stays bounded however many days exist.
    """
    if spec.label is None:
        raise ValueError(
            f"{spec.path} declares no label, so Tandem cannot train it: train elsewhere and "
            "`tandem models register DIR`"
        )
    with engine.connect() as conn:
        rows = valid_rows_between(spec, conn, first_day, holdout_day + timedelta(days=1))
    if rows.is_empty():
        raise ValueError(f"no valid {spec.spec.plural} between {first_day} and {holdout_day}")
    rows = rows.sort(_timeline_order(spec))
    features = build_features(spec, rows, rows, int(config["history_length"]))
    # A record whose outcome is not known (a blank label) is history for the others, never an example.
    labelled = rows[spec.label.name].is_not_null().to_numpy()
    if not labelled.any():
        raise ValueError(f"no labelled {spec.spec.plural} between {first_day} and {holdout_day}: nothing to learn")
    labels = rows[spec.label.name].fill_null(0).to_numpy().astype(np.float32)
    is_holdout = (rows["partition_date"] == holdout_day).to_numpy()

    train_positions = np.flatnonzero(~is_holdout & labelled)
    if train_positions.size > max_train_rows:
        rng = np.random.default_rng(seed)
        positives = train_positions[labels[train_positions] == 1]
        negatives = train_positions[labels[train_positions] == 0]
        keep = max(max_train_rows - positives.size, 0)
        train_positions = np.sort(np.concatenate([positives, rng.choice(negatives, size=keep, replace=False)]))
    holdout_positions = np.flatnonzero(is_holdout & labelled)
    train = features.take(train_positions)
    if spec.spec.augment_training is not None:
        train = dataclasses.replace(train, arrays=spec.spec.augment_training(train.arrays, seed))
    return fit(
        spec,
        train,
        labels[train_positions],
        features.take(holdout_positions),
        labels[holdout_positions],
        config=config,
        seed=seed,
        epochs=spec.spec.train_epochs if epochs is None else epochs,
        batch_size=spec.spec.train_batch_size,
    )


def split_days(days: list[date]) -> tuple[date, date]:
    """(first training day, holdout day): the last day is held out."""
    if len(days) < 2:
        raise ValueError("training needs at least two days: one to learn from, one held out")
    ordered = sorted(days)
    return ordered[0], ordered[-1]


def evaluate_auc(engine: Engine, spec: LoadedSpec, model: LoadedModel, *, first_day: date, holdout_day: date) -> float:
    """AUC of `model` on `holdout_day`, with history from the days before it (to compare versions)."""
    assert spec.label is not None, "train_from_store refuses a spec without a label first"
    with engine.connect() as conn:
        rows = valid_rows_between(spec, conn, first_day, holdout_day + timedelta(days=1))
    rows = rows.sort(_timeline_order(spec))
    holdout = rows.filter((rows["partition_date"] == holdout_day) & rows[spec.label.name].is_not_null())
    if holdout.is_empty():
        return float("nan")  # no outcome known that day: nothing to compare on
    features = build_features(spec, holdout, rows, model.history_length)
    scores = np.concatenate([score_batch(model, features.slice(s, s + 8192)) for s in range(0, len(features), 8192)])
    return auc(scores, holdout[spec.label.name].to_numpy())
