"""The reference's training hook masks a seeded share of categorical values into the unknown bucket, so it is learnt."""

from __future__ import annotations

import functools
from collections.abc import Callable
from datetime import date, timedelta

import numpy as np
import polars as pl
import pytest
from sqlalchemy.engine import Engine

from inference.batch import ingest_day
from inference.features import FeatureBatch, build_features
from inference.records import split_valid
from inference.training import train_from_store
from tandem_specs.transactions.demo import DemoConfig, generate_day
from tandem_specs.transactions.features import CURRENT_CATEGORICAL
from tandem_specs.transactions.model import EMBEDDING_SIZES, UNKNOWN_MASK_SHARE, mask_to_unknown
from tests.inference.support import DAY
from tests.reference import REFERENCE

K = 8
LABEL = "label_fraud"
CURRENT_SIZES, HISTORY_SIZES = EMBEDDING_SIZES
# (field, its column in the current categoricals, its unknown bucket)
UNSEEN_FIELD_COLUMNS = tuple(
    (name, CURRENT_CATEGORICAL.index(f"{name}_idx"), CURRENT_SIZES[CURRENT_CATEGORICAL.index(f"{name}_idx")] - 1)
    for name in ("country", "currency", "merchant_category")
)


@functools.cache
def features() -> FeatureBatch:
    valid, _ = split_valid(
        REFERENCE, generate_day(DAY, DemoConfig(seed=4, rows_per_day=6_000, poison_rate=0.0, unseen_rate=0.0))
    )
    return build_features(REFERENCE, valid, valid, K)


def test_a_small_seeded_share_of_categoricals_becomes_the_unknown_bucket() -> None:
    original = features()
    masked = mask_to_unknown(original.arrays, 7, share=UNKNOWN_MASK_SHARE)
    for name, column, unknown in UNSEEN_FIELD_COLUMNS:
        assert not (original.arrays[0][:, column] == unknown).any(), name
        share = (masked[0][:, column] == unknown).mean()
        assert 0.5 * UNKNOWN_MASK_SHARE < share < 1.5 * UNKNOWN_MASK_SHARE, name
    # Hour and weekday are not vocabulary fields: untouched.
    for name in ("hour", "weekday"):
        column = CURRENT_CATEGORICAL.index(name)
        assert np.array_equal(masked[0][:, column], original.arrays[0][:, column])

    history_unknown = np.array([size - 1 for size in HISTORY_SIZES])
    hit = masked[2] == history_unknown
    mask = original.arrays[4][:, :, None]
    assert 0.5 * UNKNOWN_MASK_SHARE < hit[np.broadcast_to(mask, hit.shape)].mean() < 1.5 * UNKNOWN_MASK_SHARE
    # Padding stays padding; nothing but the chosen values changes.
    assert not (hit & ~mask).any()
    changed = masked[2] != original.arrays[2]
    assert np.array_equal(changed, hit)
    assert np.array_equal(masked[1], original.arrays[1])
    assert np.array_equal(masked[4], original.arrays[4])


def test_masking_is_deterministic_and_leaves_the_input_alone() -> None:
    original = features()
    before = original.arrays[0].copy(), original.arrays[2].copy()
    first = mask_to_unknown(original.arrays, 7, share=UNKNOWN_MASK_SHARE)
    again = mask_to_unknown(original.arrays, 7, share=UNKNOWN_MASK_SHARE)
    other = mask_to_unknown(original.arrays, 8, share=UNKNOWN_MASK_SHARE)
    assert np.array_equal(first[0], again[0])
    assert np.array_equal(first[2], again[2])
    assert not np.array_equal(first[0], other[0])
    assert np.array_equal(original.arrays[0], before[0])
    assert np.array_equal(original.arrays[2], before[1])


@pytest.mark.parametrize("share", [0.0])
def test_share_zero_changes_nothing(share: float) -> None:
    original = features()
    masked = mask_to_unknown(original.arrays, 7, share=share)
    assert np.array_equal(masked[0], original.arrays[0])
    assert np.array_equal(masked[2], original.arrays[2])


def _stored_days(engine: Engine, label_of: Callable[[int], int | None]) -> tuple[date, date]:
    """Two demo days stored with `label_of(row)` as each row's label (None: not known)."""
    days = (DAY, DAY + timedelta(days=1))
    for day in days:
        valid, _ = split_valid(REFERENCE, generate_day(day, DemoConfig(seed=5, rows_per_day=120, poison_rate=0.0)))
        labels = pl.Series(LABEL, [label_of(row) for row in range(valid.height)], dtype=pl.Int16)
        report = ingest_day(REFERENCE, engine, valid.drop("event_ts").with_columns(labels), day)
        assert report.rows_labelled == labels.count()
    return days


def test_a_record_whose_outcome_is_not_known_is_history_never_an_example(sqlite_engine: Engine) -> None:
    """A blank label was trained, and evaluated, as 0."""
    first, holdout = _stored_days(sqlite_engine, lambda row: None if row % 3 == 0 else row % 2)
    config = REFERENCE.spec.model_config(K)
    _, report = train_from_store(
        sqlite_engine, REFERENCE, first_day=first, holdout_day=holdout, config=config, seed=1, epochs=1
    )
    assert (report.train_rows, report.holdout_rows) == (80, 80)


def test_days_without_a_known_outcome_are_refused_not_learnt_as_all_negative(sqlite_engine: Engine) -> None:
    first, holdout = _stored_days(sqlite_engine, lambda row: None)
    with pytest.raises(ValueError, match="no labelled transactions"):
        train_from_store(
            sqlite_engine, REFERENCE, first_day=first, holdout_day=holdout, config={"history_length": K}, seed=1
        )
