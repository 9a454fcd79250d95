"""Training data from the store: features through the same pipeline scoring uses."""

from __future__ import annotations

import dataclasses
from datetime import date, timedelta

import numpy as np
from sqlalchemy.engine import Engine

from inference.features import FeatureBatch, build_features
from inference.model import ModelConfig, RiskModel, TrainingReport, auc, embedding_sizes, score_batch, train_model
from inference.spec import LoadedSpec
from inference.store import valid_rows_between

# Share of the training rows' categorical values (currency, category, country; the record's and
# its history's) replaced by their field's unknown index. Without it no training row ever holds
# the unknown index (every stored value is in the vocabulary), so the unknown embedding rows keep
# their random initialisation and an unseen value would get an arbitrary score. Masking a small
# share (as word dropout trains an NLP model's UNK token) teaches each row "a value of this field
# the model cannot tell apart", and costs the known values next to nothing.
UNKNOWN_MASK_SHARE = 0.02


def mask_to_unknown(features: FeatureBatch, *, share: float, seed: int) -> FeatureBatch:
    """A copy of `features` with a seeded `share` of categorical values set to the unknown bucket.

    History padding (mask False) stays padding; history indices are shifted by one (0 = padding).
    """
    current_categorical, current_numeric, history_categorical, history_numeric, history_mask = features.arrays
    current_sizes, history_sizes = embedding_sizes()
    rng = np.random.default_rng([seed, 0x0B5E])
    current = current_categorical.copy()
    # The vocabulary columns in the order `unseen_fields` names them (country, currency,
    # merchant_category), so the seeded draws fall as they always have.
    for column in (2, 0, 1):
        current[rng.random(len(features)) < share, column] = current_sizes[column] - 1
    history_unknown = np.array([size - 1 for size in history_sizes], dtype=np.int64)
    hit = (rng.random(history_categorical.shape) < share) & history_mask[:, :, None]
    history = np.where(hit, history_unknown, history_categorical)
    arrays = (current, current_numeric, history, history_numeric, history_mask)
    return dataclasses.replace(features, arrays=arrays)


def train_from_store(
    engine: Engine,
    spec: LoadedSpec,
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
    features = build_features(spec, rows, rows, config.history_length)
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
        mask_to_unknown(features.take(train_positions), share=UNKNOWN_MASK_SHARE, seed=seed),
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


def evaluate_auc(engine: Engine, spec: LoadedSpec, model: RiskModel, *, first_day: date, holdout_day: date) -> float:
    """AUC of `model` on `holdout_day`, with history from the days before it (to compare versions)."""
    with engine.connect() as conn:
        rows = valid_rows_between(conn, first_day, holdout_day + timedelta(days=1))
    rows = rows.sort(["account_id", "event_ts", "transaction_id"])
    holdout = rows.filter(rows["partition_date"] == holdout_day)
    features = build_features(spec, holdout, rows, model.config.history_length)
    scores = np.concatenate([score_batch(model, features.slice(s, s + 8192)) for s in range(0, len(features), 8192)])
    return auc(scores, holdout["label_fraud"].fill_null(0).to_numpy())
