"""Training data from the store: features through the same pipeline scoring uses."""

from __future__ import annotations

from datetime import date, timedelta

import numpy as np
from sqlalchemy.engine import Engine

from inference.features import build_features
from inference.model import ModelConfig, RiskModel, TrainingReport, auc, score_batch, train_model
from inference.store import valid_rows_between


def train_from_store(
    engine: Engine,
    *,
    first_day: date,
    holdout_day: date,
    config: ModelConfig,
    seed: int,
    epochs: int = 2,
    max_train_rows: int = 60_000,
) -> tuple[RiskModel, TrainingReport]:
    """Train on valid rows of [first_day, holdout_day), evaluate AUC on holdout_day.

    Large training sets are subsampled deterministically (every fraud kept, negatives thinned),
    so training time stays bounded however many days exist.
    """
    with engine.connect() as conn:
        rows = valid_rows_between(conn, first_day, holdout_day + timedelta(days=1))
    if rows.is_empty():
        raise ValueError(f"no valid transactions between {first_day} and {holdout_day}")
    rows = rows.sort(["account_id", "event_ts", "transaction_id"])
    features = build_features(rows, rows, config.history_length)
    labels = rows["label_fraud"].fill_null(0).to_numpy().astype(np.float32)
    is_holdout = (rows["partition_date"] == holdout_day).to_numpy()

    train_positions = np.flatnonzero(~is_holdout)
    if train_positions.size > max_train_rows:
        rng = np.random.default_rng(seed)
        positives = train_positions[labels[train_positions] == 1]
        negatives = train_positions[labels[train_positions] == 0]
        keep = max(max_train_rows - positives.size, 0)
        train_positions = np.sort(np.concatenate([positives, rng.choice(negatives, size=keep, replace=False)]))
    holdout_positions = np.flatnonzero(is_holdout)
    return train_model(
        features.take(train_positions),
        labels[train_positions],
        features.take(holdout_positions),
        labels[holdout_positions],
        config=config,
        seed=seed,
        epochs=epochs,
    )


def split_days(days: list[date]) -> tuple[date, date]:
    """(first training day, holdout day): the last day is held out."""
    if len(days) < 2:
        raise ValueError("training needs at least two days: one to learn from, one held out")
    ordered = sorted(days)
    return ordered[0], ordered[-1]


def evaluate_auc(engine: Engine, model: RiskModel, *, first_day: date, holdout_day: date) -> float:
    """AUC of `model` on `holdout_day`, with history from the days before it (to compare versions)."""
    with engine.connect() as conn:
        rows = valid_rows_between(conn, first_day, holdout_day + timedelta(days=1))
    rows = rows.sort(["account_id", "event_ts", "transaction_id"])
    holdout = rows.filter(rows["partition_date"] == holdout_day)
    features = build_features(holdout, rows, model.config.history_length)
    scores = np.concatenate([score_batch(model, features.slice(s, s + 8192)) for s in range(0, len(features), 8192)])
    return auc(scores, holdout["label_fraud"].fill_null(0).to_numpy())
