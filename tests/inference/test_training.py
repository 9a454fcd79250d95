"""Training masks a seeded share of categorical values into the unknown bucket, so it is learnt."""

from __future__ import annotations

import functools

import numpy as np
import pytest

from inference.demo import DemoConfig, generate_day
from inference.features import (
    CURRENT_CATEGORICAL,
    UNKNOWN_CATEGORY,
    UNKNOWN_COUNTRY,
    UNSEEN_FIELD_COLUMNS,
    FeatureBatch,
    build_features,
)
from inference.records import split_valid
from inference.training import UNKNOWN_MASK_SHARE, mask_to_unknown
from tests.inference.support import DAY
from tests.reference import REFERENCE

K = 8


@functools.cache
def features() -> FeatureBatch:
    valid, _ = split_valid(
        REFERENCE, generate_day(DAY, DemoConfig(seed=4, rows_per_day=6_000, poison_rate=0.0, unseen_rate=0.0))
    )
    return build_features(valid, valid, K)


def test_a_small_seeded_share_of_categoricals_becomes_the_unknown_bucket() -> None:
    original = features()
    masked = mask_to_unknown(original, share=UNKNOWN_MASK_SHARE, seed=7)
    for name, column, unknown in UNSEEN_FIELD_COLUMNS:
        assert not (original.current_categorical[:, column] == unknown).any(), name
        share = (masked.current_categorical[:, column] == unknown).mean()
        assert 0.5 * UNKNOWN_MASK_SHARE < share < 1.5 * UNKNOWN_MASK_SHARE, name
    # Hour and weekday are not vocabulary fields: untouched.
    for name in ("hour", "weekday"):
        column = CURRENT_CATEGORICAL.index(name)
        assert np.array_equal(masked.current_categorical[:, column], original.current_categorical[:, column])

    history_unknown = np.array([UNKNOWN_CATEGORY + 1, UNKNOWN_COUNTRY + 1])
    hit = masked.history_categorical == history_unknown
    mask = original.history_mask[:, :, None]
    assert 0.5 * UNKNOWN_MASK_SHARE < hit[np.broadcast_to(mask, hit.shape)].mean() < 1.5 * UNKNOWN_MASK_SHARE
    # Padding stays padding; nothing but the chosen values changes.
    assert not (hit & ~mask).any()
    changed = masked.history_categorical != original.history_categorical
    assert np.array_equal(changed, hit)
    assert np.array_equal(masked.current_numeric, original.current_numeric)
    assert np.array_equal(masked.history_mask, original.history_mask)


def test_masking_is_deterministic_and_leaves_the_input_alone() -> None:
    original = features()
    before = original.current_categorical.copy(), original.history_categorical.copy()
    first = mask_to_unknown(original, share=UNKNOWN_MASK_SHARE, seed=7)
    again = mask_to_unknown(original, share=UNKNOWN_MASK_SHARE, seed=7)
    other = mask_to_unknown(original, share=UNKNOWN_MASK_SHARE, seed=8)
    assert np.array_equal(first.current_categorical, again.current_categorical)
    assert np.array_equal(first.history_categorical, again.history_categorical)
    assert not np.array_equal(first.current_categorical, other.current_categorical)
    assert np.array_equal(original.current_categorical, before[0])
    assert np.array_equal(original.history_categorical, before[1])


@pytest.mark.parametrize("share", [0.0])
def test_share_zero_changes_nothing(share: float) -> None:
    original = features()
    masked = mask_to_unknown(original, share=share, seed=7)
    assert np.array_equal(masked.current_categorical, original.current_categorical)
    assert np.array_equal(masked.history_categorical, original.history_categorical)
