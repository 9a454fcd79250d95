"""The reference's demo: accounts with histories, a learnable fraud signal, realistic poison.

Each day is generated from its own seed (seed, day), so one day can be regenerated alone and comes
out identical to the same day inside a long range; that is what makes partition reruns comparable.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from datetime import UTC, date, datetime, timedelta

import numpy as np
import polars as pl

from inference.spec import DemoSettings, GenericReason, LoadedSpec
from tandem_specs.transactions.records import COUNTRIES, CURRENCIES, MERCHANT_CATEGORIES

# The record's columns, in the spec's field order.
RAW_COLUMNS = ("transaction_id", "account_id", "amount", "currency", "merchant_category", "country", "event_time")
RISKY_CATEGORIES = ("electronics", "jewelry", "gift_cards", "crypto_exchange", "money_transfer", "gambling")
HOME_CURRENCY = {
    "US": "USD",
    "CA": "CAD",
    "GB": "GBP",
    "JP": "JPY",
    "CH": "CHF",
    "AU": "AUD",
    "SE": "SEK",
}
BASE_FRAUD_RATE = 0.02
# Well-formed values outside the training vocabulary (records.py): what a new merchant category,
# a new market or a new currency looks like on its first day. Not poison: they are scored
# through the model's unknown bucket and flagged, so the drift metadata has something to show.
UNSEEN_VALUES: tuple[tuple[str, str], ...] = (
    ("merchant_category", "ev_charging"),
    ("country", "KR"),
    ("currency", "KRW"),
)


class PoisonKind(enum.StrEnum):
    BAD_CURRENCY = "bad_currency"
    NAN_AMOUNT = "nan_amount"
    NEGATIVE_AMOUNT = "negative_amount"
    ABSURD_AMOUNT = "absurd_amount"
    MALFORMED_CATEGORY = "malformed_category"
    MALFORMED_COUNTRY = "malformed_country"
    MISSING_TIMESTAMP = "missing_timestamp"
    UNPARSABLE_TIMESTAMP = "unparsable_timestamp"
    DUPLICATE_ID = "duplicate_id"


# The reason validation gives each kind (the codes the spec declares, tandem_specs.transactions).
EXPECTED_REASON: dict[PoisonKind, str] = {
    PoisonKind.BAD_CURRENCY: "bad_currency",
    PoisonKind.NAN_AMOUNT: "amount_not_finite",
    PoisonKind.NEGATIVE_AMOUNT: "amount_negative",
    PoisonKind.ABSURD_AMOUNT: "amount_absurd",
    PoisonKind.MALFORMED_CATEGORY: "malformed_category",
    PoisonKind.MALFORMED_COUNTRY: "malformed_country",
    PoisonKind.MISSING_TIMESTAMP: GenericReason.TIMESTAMP_MISSING.value,
    PoisonKind.UNPARSABLE_TIMESTAMP: GenericReason.TIMESTAMP_UNPARSABLE.value,
    PoisonKind.DUPLICATE_ID: GenericReason.DUPLICATE_ID.value,
}


@dataclass(frozen=True)
class DemoConfig:
    """The generator's knobs: the demo settings' seed, rows and poison rate, and two of its own."""

    seed: int = 7
    rows_per_day: int = 20_000
    poison_rate: float = 0.01
    unseen_rate: float = 0.002  # clean rows given one UNSEEN_VALUES value each
    accounts: int | None = None  # None: one account per ten daily rows

    @property
    def account_count(self) -> int:
        return self.accounts if self.accounts is not None else max(50, self.rows_per_day // 10)


@dataclass(frozen=True)
class _Accounts:
    home_country: np.ndarray
    home_currency: np.ndarray
    log_amount_mean: np.ndarray
    favourite_categories: np.ndarray  # (n, 3) indices into MERCHANT_CATEGORIES
    activity: np.ndarray  # sampling weights


def _accounts(config: DemoConfig) -> _Accounts:
    rng = np.random.default_rng([config.seed, 0])
    n = config.account_count
    home = rng.choice(len(COUNTRIES), size=n, p=_country_weights())
    currency = np.array([CURRENCIES.index(HOME_CURRENCY.get(COUNTRIES[c], "EUR")) for c in home], dtype=np.int64)
    activity = rng.pareto(2.0, size=n) + 0.2
    return _Accounts(
        home_country=home,
        home_currency=currency,
        log_amount_mean=rng.normal(3.3, 0.8, size=n),
        favourite_categories=rng.choice(len(MERCHANT_CATEGORIES), size=(n, 3)),
        activity=activity / activity.sum(),
    )


def _country_weights() -> np.ndarray:
    weights = np.ones(len(COUNTRIES))
    for common in ("US", "GB", "DE", "FR", "CA"):
        weights[COUNTRIES.index(common)] = 6.0
    return weights / weights.sum()


def generate_day(day: date, config: DemoConfig) -> pl.DataFrame:
    """One day's source records in RAW_SCHEMA order, plus `label_fraud` and `poison_kind`."""
    accounts = _accounts(config)
    rng = np.random.default_rng([config.seed, day.toordinal()])
    n = config.rows_per_day
    account = rng.choice(config.account_count, size=n, p=accounts.activity)
    is_fraud = rng.random(n) < BASE_FRAUD_RATE

    seconds = np.sort(rng.uniform(0, 86_400, size=n))
    night = rng.uniform(0, 5 * 3600, size=n)
    seconds = np.where(is_fraud & (rng.random(n) < 0.5), night, seconds)

    favourite = accounts.favourite_categories[account, rng.integers(0, 3, size=n)]
    habitual = np.where(rng.random(n) < 0.8, favourite, rng.integers(0, len(MERCHANT_CATEGORIES), n))
    risky = np.array([MERCHANT_CATEGORIES.index(c) for c in RISKY_CATEGORIES])[
        rng.integers(0, len(RISKY_CATEGORIES), size=n)
    ]
    category = np.where(is_fraud & (rng.random(n) < 0.7), risky, habitual)

    home = accounts.home_country[account]
    abroad = rng.integers(0, len(COUNTRIES), size=n)
    travelling = rng.random(n) < np.where(is_fraud, 0.7, 0.05)
    country = np.where(travelling, abroad, home)

    currency = np.where(rng.random(n) < 0.97, accounts.home_currency[account], rng.integers(0, len(CURRENCIES), n))
    amount = np.exp(rng.normal(accounts.log_amount_mean[account], 0.5))
    amount = np.where(is_fraud, amount * rng.uniform(4.0, 20.0, size=n), amount)
    amount = np.round(amount, 2)

    midnight = datetime(day.year, day.month, day.day, tzinfo=UTC)
    event_us = (midnight.timestamp() * 1e6 + seconds * 1e6).astype(np.int64)
    frame = pl.DataFrame(
        {
            "transaction_id": pl.Series(np.arange(n)).cast(pl.String).str.zfill(7),
            "account_id": pl.Series(account).cast(pl.String).str.zfill(6),
            "amount": amount,
            "currency": pl.Series(CURRENCIES).gather(currency),
            "merchant_category": pl.Series(MERCHANT_CATEGORIES).gather(category),
            "country": pl.Series(COUNTRIES).gather(country),
            "event_time": pl.Series(event_us).cast(pl.Datetime("us", "UTC")).dt.strftime("%Y-%m-%dT%H:%M:%S.%6fZ"),
            "label_fraud": is_fraud.astype(np.int8),
        }
    ).with_columns(
        transaction_id=pl.lit(f"tx-{day:%Y%m%d}-") + pl.col("transaction_id"),
        account_id=pl.lit("acct-") + pl.col("account_id"),
    )
    # Its own stream, so the rest of the day is what it was before unseen values were added.
    return _unseen(
        _poison(frame, rng, config.poison_rate),
        np.random.default_rng([config.seed, day.toordinal(), 1]),
        config.unseen_rate,
    )


def _poison(frame: pl.DataFrame, rng: np.random.Generator, rate: float) -> pl.DataFrame:
    n = frame.height
    count = min(round(n * rate), n - 1)
    if count <= 0:
        return frame.with_columns(poison_kind=pl.lit(None, dtype=pl.String))
    # Index 0 never gets poisoned so a duplicated id always has an earlier original to copy.
    rows = np.sort(rng.choice(np.arange(1, n), size=count, replace=False))
    kinds = np.array([kind.value for kind in PoisonKind])[np.arange(count) % len(PoisonKind)]
    columns = {name: frame[name].clone() for name in RAW_COLUMNS}

    def rows_of(kind: PoisonKind) -> np.ndarray:
        return rows[kinds == kind.value]

    def put(column: str, kind: PoisonKind, values: list[object] | np.ndarray) -> None:
        where = rows_of(kind)
        if where.size:
            columns[column] = columns[column].scatter(where, pl.Series(values, dtype=columns[column].dtype))

    def cycle(options: tuple[object, ...], size: int) -> list[object]:
        return [options[i % len(options)] for i in range(size)]

    # Malformed, every one: a well-formed unseen value ("XXX", "KR") is scored, not poison.
    put("currency", PoisonKind.BAD_CURRENCY, cycle(("usd", "US$", "", "EURO"), rows_of(PoisonKind.BAD_CURRENCY).size))
    put("amount", PoisonKind.NAN_AMOUNT, np.full(rows_of(PoisonKind.NAN_AMOUNT).size, np.nan))
    put("amount", PoisonKind.NEGATIVE_AMOUNT, -frame["amount"].to_numpy()[rows_of(PoisonKind.NEGATIVE_AMOUNT)] - 0.01)
    put("amount", PoisonKind.ABSURD_AMOUNT, np.full(rows_of(PoisonKind.ABSURD_AMOUNT).size, 3.7e9))
    put(
        "merchant_category",
        PoisonKind.MALFORMED_CATEGORY,
        cycle(("", "   ", "<script>", "x" * 65), rows_of(PoisonKind.MALFORMED_CATEGORY).size),
    )
    put(
        "country",
        PoisonKind.MALFORMED_COUNTRY,
        cycle(("usa", "us", "U5", ""), rows_of(PoisonKind.MALFORMED_COUNTRY).size),
    )
    put("event_time", PoisonKind.MISSING_TIMESTAMP, [None] * rows_of(PoisonKind.MISSING_TIMESTAMP).size)
    put(
        "event_time",
        PoisonKind.UNPARSABLE_TIMESTAMP,
        cycle(("31/11/2026 25:61", "yesterday", "2026-13-45T99:00:00Z"), rows_of(PoisonKind.UNPARSABLE_TIMESTAMP).size),
    )
    duplicates = rows_of(PoisonKind.DUPLICATE_ID)
    originals = (rng.random(duplicates.size) * duplicates).astype(np.int64)
    put("transaction_id", PoisonKind.DUPLICATE_ID, frame["transaction_id"].gather(originals).to_list())

    poison_kind = pl.Series("poison_kind", [None] * n, dtype=pl.String).scatter(rows, pl.Series(kinds))
    return pl.DataFrame(columns).with_columns(label_fraud=frame["label_fraud"], poison_kind=poison_kind)


def _unseen(frame: pl.DataFrame, rng: np.random.Generator, rate: float) -> pl.DataFrame:
    """About `rate` of the clean rows get one of UNSEEN_VALUES each (dealt round-robin)."""
    clean = np.flatnonzero(frame["poison_kind"].is_null().to_numpy())
    count = min(round(frame.height * rate), clean.size)
    if count <= 0:
        return frame
    rows = np.sort(rng.choice(clean, size=count, replace=False))
    columns = {}
    for offset, (column, value) in enumerate(UNSEEN_VALUES):
        where = rows[offset :: len(UNSEEN_VALUES)]
        if where.size:
            columns[column] = frame[column].scatter(where, pl.Series([value] * where.size, dtype=pl.String))
    return frame.with_columns(**columns)


def generate_days(start: date, days: int, config: DemoConfig) -> pl.DataFrame:
    return pl.concat([generate_day(start + timedelta(days=offset), config) for offset in range(days)])


def demo(ls: LoadedSpec, day: date, settings: DemoSettings) -> pl.DataFrame:
    """The spec's demo hook: the generated day, its rows and poison as the settings ask, with
    `poison_kind` (not written to the landing location)."""
    config = DemoConfig(seed=settings.seed, rows_per_day=settings.rows_per_day, poison_rate=settings.poison_rate)
    return generate_day(day, config)
