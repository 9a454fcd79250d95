"""One feature pipeline for a 1M-row partition and for a single online record.

Where the history comes from is a parameter (`history`): any frame holding the accounts' valid
transactions. A partition passes its own rows plus the days before; the service passes rows
fetched from the store. Both feed the same sort-and-shift below, so a record's features are
identical either way (a property test holds us to it).
"""

from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass

import numpy as np
import polars as pl
import torch

from inference.records import COUNTRIES, CURRENCIES, MERCHANT_CATEGORIES, USD_PER_UNIT

FEATURE_COLUMNS = ("transaction_id", "account_id", "amount", "currency", "merchant_category", "country", "event_ts")
CURRENT_CATEGORICAL = ("currency_idx", "category_idx", "country_idx", "hour", "weekday")
CURRENT_CATEGORICAL_CARDINALITY = (len(CURRENCIES), len(MERCHANT_CATEGORIES), len(COUNTRIES), 24, 7)
CURRENT_NUMERIC = (
    "amount_log",
    "history_fill",
    "amount_vs_history_mean",
    "amount_vs_history_max",
    "same_country_share",
    "same_category_share",
    "since_previous_log",
    "has_history",
)
# History item categoricals are shifted by one: 0 is the padding slot of an empty history.
HISTORY_CATEGORICAL_CARDINALITY = (len(MERCHANT_CATEGORIES) + 1, len(COUNTRIES) + 1)
HISTORY_NUMERIC_WIDTH = 4
# Scales log-seconds (a week is about 13.3) into roughly [0, 1].
LOG_SECONDS_SCALE = 12.0
# Polars divides a column by a scalar either truly or as a multiplication by the reciprocal,
# depending on the column's (chunk) length, so `x / c` can differ in the last bit between a
# partition and a single record. Multiplying by the reciprocal ourselves gives the same bits always.
_PER_LOG_SECOND = 1.0 / LOG_SECONDS_SCALE
_SECONDS_PER_MICROSECOND = 1e-6
_MAX_HISTORY = 256
# One odd 64-bit weight per lag, derived from a fixed string so they never change with a library
# version: the digest is stored, and a digest that changed by itself would rewrite every score.
_LAG_WEIGHTS = np.array(
    [
        int.from_bytes(hashlib.sha256(f"tandem-history-lag-{i}".encode()).digest()[:8], "big") | 1
        for i in range(_MAX_HISTORY)
    ],
    dtype=np.uint64,
)


@dataclass(frozen=True)
class FeatureBatch:
    """Model inputs for N transactions, rows in the order of the targets given."""

    transaction_ids: list[str]
    current_categorical: np.ndarray  # int64 [N, 5]
    current_numeric: np.ndarray  # float32 [N, 8]
    history_categorical: np.ndarray  # int64 [N, K, 2]
    history_numeric: np.ndarray  # float32 [N, K, 4]
    history_mask: np.ndarray  # bool [N, K]
    # Per row, a digest of the stored records its history was built from (see `build_features`).
    history_digests: list[str] | None = None

    def __len__(self) -> int:
        return len(self.transaction_ids)

    def slice(self, start: int, stop: int) -> FeatureBatch:
        return FeatureBatch(
            transaction_ids=self.transaction_ids[start:stop],
            current_categorical=self.current_categorical[start:stop],
            current_numeric=self.current_numeric[start:stop],
            history_categorical=self.history_categorical[start:stop],
            history_numeric=self.history_numeric[start:stop],
            history_mask=self.history_mask[start:stop],
            history_digests=None if self.history_digests is None else self.history_digests[start:stop],
        )

    def take(self, rows: np.ndarray) -> FeatureBatch:
        return FeatureBatch(
            transaction_ids=[self.transaction_ids[i] for i in rows],
            current_categorical=self.current_categorical[rows],
            current_numeric=self.current_numeric[rows],
            history_categorical=self.history_categorical[rows],
            history_numeric=self.history_numeric[rows],
            history_mask=self.history_mask[rows],
            history_digests=None if self.history_digests is None else [self.history_digests[i] for i in rows],
        )

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """Zero-copy views in the argument order of `RiskModel.forward`."""
        return (
            torch.from_numpy(self.current_categorical),
            torch.from_numpy(self.current_numeric),
            torch.from_numpy(self.history_categorical),
            torch.from_numpy(self.history_numeric),
            torch.from_numpy(self.history_mask),
        )


def _index_of(column: str, vocabulary: tuple[str, ...]) -> pl.Expr:
    mapping = {value: index for index, value in enumerate(vocabulary)}
    return pl.col(column).replace_strict(mapping, return_dtype=pl.Int64)


def _encoded(frame: pl.DataFrame) -> pl.DataFrame:
    rate = pl.col("currency").replace_strict(USD_PER_UNIT, return_dtype=pl.Float64)
    return frame.with_columns(
        amount_log=(pl.col("amount") * rate).log1p(),
        currency_idx=_index_of("currency", CURRENCIES),
        category_idx=_index_of("merchant_category", MERCHANT_CATEGORIES),
        country_idx=_index_of("country", COUNTRIES),
        hour=pl.col("event_ts").dt.hour().cast(pl.Int64),
        weekday=(pl.col("event_ts").dt.weekday() - 1).cast(pl.Int64),
        epoch_s=pl.col("event_ts").dt.epoch("us").cast(pl.Float64) * _SECONDS_PER_MICROSECOND,
    )


@dataclass(frozen=True)
class _LagPlan:
    """The polars expressions for K lags, built once per K: rebuilding ~100 expressions per call
    cost more than the query itself on the single-record online path."""

    history_columns: tuple[pl.Expr, ...]
    digest_columns: tuple[pl.Expr, ...]
    digest_names: list[str]
    current_columns: dict[str, pl.Expr]
    valid_names: list[str]
    category_names: list[str]
    country_names: list[str]
    amount_names: list[str]
    delta_names: list[str]


@functools.cache
def _lag_plan(k: int) -> _LagPlan:
    history_columns: list[pl.Expr] = []
    valid_names: list[str] = []
    category_names: list[str] = []
    country_names: list[str] = []
    amount_names: list[str] = []
    delta_names: list[str] = []
    digest_columns: list[pl.Expr] = []
    digest_names: list[str] = []
    for back in range(1, k + 1):
        # Shifting the whole sorted timeline is a grouped shift once rows of other accounts are
        # masked out, and much cheaper than `.over(account_id)` on a million rows.
        valid = (pl.col("account_id").shift(back) == pl.col("account_id")).fill_null(False)
        names = (f"h{back}_valid", f"h{back}_category", f"h{back}_country", f"h{back}_amount", f"h{back}_delta")
        history_columns += [
            valid.alias(names[0]),
            pl.when(valid).then(pl.col("category_idx").shift(back) + 1).otherwise(0).alias(names[1]),
            pl.when(valid).then(pl.col("country_idx").shift(back) + 1).otherwise(0).alias(names[2]),
            pl.when(valid).then(pl.col("amount_log").shift(back)).alias(names[3]),
            pl.when(valid)
            .then((pl.col("epoch_s") - pl.col("epoch_s").shift(back)).clip(lower_bound=0.0).log1p() * _PER_LOG_SECOND)
            .alias(names[4]),
        ]
        digest_names.append(f"h{back}_record")
        digest_columns.append(
            pl.when(valid).then(pl.col("record_number").shift(back)).otherwise(0).alias(digest_names[-1])
        )
        for collection, name in zip(
            (valid_names, category_names, country_names, amount_names, delta_names), names, strict=True
        ):
            collection.append(name)

    filled = pl.sum_horizontal([pl.col(name).cast(pl.Int64) for name in valid_names])
    has_history = filled > 0
    shares = {
        "same_country_share": [(pl.col(name) == pl.col("country_idx") + 1) for name in country_names],
        "same_category_share": [(pl.col(name) == pl.col("category_idx") + 1) for name in category_names],
    }
    current_columns = {
        "history_fill": filled.cast(pl.Float64) * (1.0 / k),
        "amount_vs_history_mean": pl.when(has_history)
        .then(pl.col("amount_log") - pl.mean_horizontal(amount_names, ignore_nulls=True))
        .otherwise(0.0),
        "amount_vs_history_max": pl.when(has_history)
        .then(pl.col("amount_log") - pl.max_horizontal(amount_names))
        .otherwise(0.0),
        **{
            name: pl.when(has_history)
            .then(pl.sum_horizontal([e.cast(pl.Int64) for e in exprs]).cast(pl.Float64) / filled)
            .otherwise(0.0)
            for name, exprs in shares.items()
        },
        "since_previous_log": pl.col(delta_names[0]).fill_null(0.0),
        "has_history": has_history.cast(pl.Float64),
    }
    return _LagPlan(
        tuple(history_columns),
        tuple(digest_columns),
        digest_names,
        current_columns,
        valid_names,
        category_names,
        country_names,
        amount_names,
        delta_names,
    )


def build_features(targets: pl.DataFrame, history: pl.DataFrame, history_length: int) -> FeatureBatch:
    """Features for every row of `targets` (valid rows: RAW columns plus `event_ts`).

    `history` holds valid rows of the same accounts; it may contain the targets themselves and
    rows after them. A target's history is the `history_length` rows of its account that sort
    before it by (event_ts, transaction_id).

    When both frames carry `input_hash`, each row also gets a digest of the input hashes of the
    records its history was built from, in order: the score depends on them as much as on the
    record itself, so a corrected, late or removed record changes the digest of every later
    record that read it.
    """
    k = history_length
    if k > _MAX_HISTORY:
        raise ValueError(f"history_length {k} exceeds {_MAX_HISTORY}")
    plan = _lag_plan(k)
    with_digest = "input_hash" in targets.columns and "input_hash" in history.columns
    columns = [*FEATURE_COLUMNS, "input_hash"] if with_digest else list(FEATURE_COLUMNS)
    wanted = targets.select(columns).with_columns(target_position=pl.int_range(pl.len(), dtype=pl.Int64))
    accounts = wanted["account_id"].unique().implode()
    past = (
        history.select(columns)
        .filter(pl.col("account_id").is_in(accounts))
        .join(wanted.select("transaction_id"), on="transaction_id", how="anti")
        .with_columns(target_position=pl.lit(None, dtype=pl.Int64))
    )
    timeline = _encoded(pl.concat([wanted, past])).sort(["account_id", "event_ts", "transaction_id"])
    lag_columns = plan.history_columns
    if with_digest:
        # 60 bits of the record's sha256 (hex), enough to tell versions of one record apart.
        timeline = timeline.with_columns(record_number=pl.col("input_hash").str.slice(0, 15).str.to_integer(base=16))
        lag_columns = (*lag_columns, *plan.digest_columns)
    current = (
        timeline.with_columns(lag_columns)
        .filter(pl.col("target_position").is_not_null())
        .with_columns(**plan.current_columns)
        .sort("target_position")
    )
    valid_names, category_names, country_names = plan.valid_names, plan.category_names, plan.country_names
    amount_names, delta_names = plan.amount_names, plan.delta_names

    n = current.height

    def block(names: list[str], dtype: type) -> np.ndarray:
        # One conversion for all K lag columns: per-column conversions dominate small batches.
        return current.select(pl.col(names).fill_null(0)).to_numpy().astype(dtype).reshape(n, k)

    categories, countries = block(category_names, np.int64), block(country_names, np.int64)
    valid_mask = block(valid_names, np.int64).astype(bool)
    own_country = current["country_idx"].to_numpy().reshape(n, 1) + 1
    history_numeric = np.stack(
        [
            block(amount_names, np.float64),
            block(delta_names, np.float64),
            (countries == own_country).astype(np.float64),
            valid_mask.astype(np.float64),
        ],
        axis=2,
    )
    return FeatureBatch(
        transaction_ids=current["transaction_id"].to_list(),
        current_categorical=current.select(CURRENT_CATEGORICAL).to_numpy().astype(np.int64).reshape(n, -1),
        current_numeric=current.select(CURRENT_NUMERIC).to_numpy().astype(np.float32).reshape(n, -1),
        history_categorical=np.ascontiguousarray(np.stack([categories, countries], axis=2)),
        history_numeric=np.ascontiguousarray(history_numeric.astype(np.float32)),
        history_mask=np.ascontiguousarray(valid_mask),
        history_digests=_history_digests(current, plan.digest_names) if with_digest else None,
    )


def _history_digests(current: pl.DataFrame, names: list[str]) -> list[str]:
    """A position-weighted sum of the history records' numbers, modulo 2**64 (numpy's uint64
    arithmetic wraps): vectorised, and with odd weights one changed record always changes it."""
    numbers = current.select(names).to_numpy().astype(np.uint64)
    digests = (numbers * _LAG_WEIGHTS[: len(names)]).sum(axis=1, dtype=np.uint64)
    return [f"{value:016x}" for value in digests.tolist()]
