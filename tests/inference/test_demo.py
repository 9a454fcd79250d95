"""The demo is deterministic by (seed, day), so partition reruns compare like with like: the
reference's generator, the diabetes landings, and the poison any spec's demo can use."""

from __future__ import annotations

import hashlib
from datetime import date, timedelta
from typing import Any

import numpy as np
import polars as pl
import pytest

from inference.demo import NoDemo, day_range, demo_day
from inference.records import raw_frame, validate
from inference.spec import POISON_REASON, DemoSettings, LoadedSpec, load_spec, poison
from tandem_specs.transactions.demo import BASE_FRAUD_RATE, DemoConfig, PoisonKind, generate_day, generate_days
from tests.inference.support import DAY
from tests.reference import RAW_COLUMNS, REFERENCE

DIABETES = load_spec("tandem_specs.diabetes:SPEC")
TINY = load_spec("tests.specs.tiny:SPEC")
# sha256 of the reference's demo day 2026-11-01 (2,000 rows, the golden test's day) as CSV,
# `poison_kind` included: the generator moved into the spec's package without changing a value.
REFERENCE_DAY_SHA256 = "32fac78902da56cc0cb8037ef9ad0f05cc7cd13501e6e07179a2c3ed7b49df61"

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


# Through the spec's hook -----------------------------------------------------------------------


def test_the_reference_demo_day_is_the_generators_day_unchanged() -> None:
    day = demo_day(REFERENCE, date(2026, 11, 1), DemoSettings(rows_per_day=2000))
    assert hashlib.sha256(day.write_csv().encode()).hexdigest() == REFERENCE_DAY_SHA256


def test_the_diabetes_demo_lands_every_patient_once_over_the_window() -> None:
    settings = DemoSettings(seed=3, start=DAY, days=7, rows_per_day=5, poison_rate=0.0)
    days = [demo_day(DIABETES, day, settings) for day in day_range(DAY, 7)]
    ids = pl.concat([day["patient_id"] for day in days])
    # rows_per_day does not apply: the 442 patients are spread over the window.
    assert ids.len() == ids.n_unique() == 442
    assert [day.height for day in days] == [64, 63, 63, 63, 63, 63, 63]
    assert demo_day(DIABETES, DAY - timedelta(days=1), settings).height == 0
    assert tuple(days[0].columns) == (*DIABETES.field_names, "progressed", POISON_REASON)


def test_a_diabetes_demo_day_is_deterministic_and_moves_with_the_seed() -> None:
    settings = DemoSettings(seed=7, start=DAY, days=7, poison_rate=0.1)
    day = demo_day(DIABETES, DAY + timedelta(days=2), settings)
    assert day.equals(demo_day(DIABETES, DAY + timedelta(days=2), settings))
    assert not day.equals(demo_day(DIABETES, DAY + timedelta(days=2), DemoSettings(seed=8, start=DAY, poison_rate=0.1)))
    assert validate(DIABETES, day)["reject_reason"].eq_missing(day[POISON_REASON]).all()


def test_a_spec_without_a_demo_says_so() -> None:
    with pytest.raises(NoDemo, match=r"spec 'tests\.specs\.tiny:SPEC' has no demo"):
        demo_day(TINY, DAY, DemoSettings())


def _clean(ls: LoadedSpec, rows: int) -> pl.DataFrame:
    """`rows` valid records: the spec's example, each with an id and a minute of its own."""
    example: dict[str, Any] = ls.spec.example()
    records = [
        {
            **example,
            ls.id.name: f"{example[ls.id.name]}-{row}",
            ls.event_time.name: f"2026-11-03T{row // 60 % 24:02d}:{row % 60:02d}:00Z",
        }
        for row in range(rows)
    ]
    return raw_frame(ls, records)


@pytest.mark.parametrize("ls", [REFERENCE, DIABETES, TINY], ids=lambda ls: ls.spec.name)
@pytest.mark.parametrize(("rows", "rate"), [(200, 0.0), (200, 0.2), (37, 0.5), (2, 1.0)])
def test_poison_breaks_rows_through_the_fields_and_says_the_reason_validation_gives(
    ls: LoadedSpec, rows: int, rate: float
) -> None:
    clean = _clean(ls, rows)
    assert validate(ls, clean)["reject_reason"].is_null().all()

    poisoned = poison(clean, ls, np.random.default_rng(5), rate)

    reasons = poisoned[POISON_REASON]
    assert reasons.drop_nulls().len() == min(round(rows * rate), rows - 1)
    assert reasons[0] is None  # a duplicated id always copies an earlier clean row
    assert validate(ls, poisoned.drop(POISON_REASON))["reject_reason"].eq_missing(reasons).all()
    assert poisoned.drop(POISON_REASON).schema == clean.schema
    assert poisoned.filter(reasons.is_null()).drop(POISON_REASON).equals(clean.filter(reasons.is_null()))
    assert poisoned.equals(poison(clean, ls, np.random.default_rng(5), rate))


@pytest.mark.parametrize("ls", [REFERENCE, DIABETES, TINY], ids=lambda ls: ls.spec.name)
def test_poison_deals_every_kind_the_spec_allows(ls: LoadedSpec) -> None:
    reasons = set(poison(_clean(ls, 400), ls, np.random.default_rng(1), 0.25)[POISON_REASON].drop_nulls())
    generic = {"missing_field", "duplicate_id", "timestamp_missing", "timestamp_unparsable", "nul_character"}
    numerics = {numeric.not_finite_code for numeric in ls.numerics}
    categoricals = {categorical.malformed_code for categorical in ls.categoricals}
    assert reasons == generic | numerics | categoricals
