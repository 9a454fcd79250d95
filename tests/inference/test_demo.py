"""The demo generator is deterministic by (seed, day), so partition reruns compare like with like."""

from __future__ import annotations

from datetime import timedelta

import polars as pl
import pytest

from inference.demo import BASE_FRAUD_RATE, DemoConfig, PoisonKind, day_range, generate_day, generate_days
from tests.inference.support import DAY
from tests.reference import RAW_COLUMNS

CONFIG = DemoConfig(seed=11, rows_per_day=1_000, poison_rate=0.02)


def test_same_seed_and_day_give_an_identical_frame() -> None:
    assert generate_day(DAY, CONFIG).equals(generate_day(DAY, CONFIG))


def test_a_day_alone_equals_the_same_day_inside_a_range() -> None:
    days = generate_days(DAY, 3, CONFIG)
    for offset, day in enumerate(day_range(DAY, 3)):
        inside = days.slice(offset * CONFIG.rows_per_day, CONFIG.rows_per_day)
        assert generate_day(day, CONFIG).equals(inside), day
    assert days.height == 3 * CONFIG.rows_per_day


def test_a_different_seed_or_day_gives_different_data() -> None:
    base = generate_day(DAY, CONFIG)
    other_seed = generate_day(DAY, DemoConfig(seed=12, rows_per_day=1_000, poison_rate=0.02))
    other_day = generate_day(DAY + timedelta(days=1), CONFIG)
    for other in (other_seed, other_day):
        assert not base.equals(other)
        assert not base.select("amount", "account_id").equals(other.select("amount", "account_id"))


def test_frame_layout() -> None:
    frame = generate_day(DAY, CONFIG)
    assert tuple(frame.columns) == (*RAW_COLUMNS, "label_fraud", "poison_kind")
    assert frame.height == CONFIG.rows_per_day
    clean = frame.filter(pl.col("poison_kind").is_null())
    assert clean["transaction_id"].is_unique().all()
    assert clean["transaction_id"].str.starts_with(f"tx-{DAY:%Y%m%d}-").all()


def test_fraud_label_rate_is_plausible() -> None:
    frame = generate_days(DAY, 2, DemoConfig(seed=5, rows_per_day=5_000, poison_rate=0.0))
    rate = frame["label_fraud"].mean()
    assert isinstance(rate, float)
    # 10k Bernoulli(0.02) draws: the standard error is 0.0014, so this band is about 4 sigma wide.
    assert BASE_FRAUD_RATE * 0.6 < rate < BASE_FRAUD_RATE * 1.4
    assert set(frame["label_fraud"].unique()) == {0, 1}


@pytest.mark.parametrize(("rows", "rate"), [(1_000, 0.0), (1_000, 0.01), (800, 0.05), (999, 0.037)])
def test_poison_count_matches_the_rate(rows: int, rate: float) -> None:
    frame = generate_day(DAY, DemoConfig(seed=2, rows_per_day=rows, poison_rate=rate))
    poisoned = frame["poison_kind"].drop_nulls()
    assert poisoned.len() == round(rows * rate)
    if poisoned.len() >= len(PoisonKind):
        # Kinds are dealt round-robin, so every kind appears and none dominates.
        counts = poisoned.value_counts()["count"]
        assert counts.len() == len(PoisonKind)
        assert counts.max() - counts.min() <= 1  # type: ignore[operator]
    # The first row is never poisoned: a duplicated id always has an earlier original.
    assert frame["poison_kind"][0] is None
