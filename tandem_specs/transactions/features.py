"""The reference model's inputs: the transaction itself, and its account's last K transactions."""

from __future__ import annotations

import numpy as np
import polars as pl

from inference.spec import Timeline

CURRENT_CATEGORICAL = ("currency_idx", "merchant_category_idx", "country_idx", "hour", "weekday")
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
HISTORY_NUMERIC_WIDTH = 4
# Scales log-seconds (a week is about 13.3) into roughly [0, 1].
LOG_SECONDS_SCALE = 12.0
# Polars divides a column by a scalar either truly or as a multiplication by the reciprocal,
# depending on the column's (chunk) length, so `x / c` can differ in the last bit between a
# partition and a single record. Multiplying by the reciprocal ourselves gives the same bits always.
_PER_LOG_SECOND = 1.0 / LOG_SECONDS_SCALE
_SECONDS_PER_MICROSECOND = 1e-6
# Converting to one unit makes amounts comparable across an account's history.
USD_PER_UNIT: dict[str, float] = {
    "USD": 1.0,
    "EUR": 1.08,
    "GBP": 1.27,
    "JPY": 0.0067,
    "CHF": 1.13,
    "CAD": 0.73,
    "AUD": 0.66,
    "SEK": 0.095,
}


def encode() -> dict[str, pl.Expr]:
    # An unseen currency has no rate. 1.0 (the amount as if in USD) keeps the feature finite and
    # the record scored; refusing it would be the drift outage the unknown bucket exists to avoid,
    # and a guessed rate would look authoritative. The row carries "currency" in `unseen_fields`.
    rate = pl.col("currency").replace_strict(USD_PER_UNIT, default=1.0, return_dtype=pl.Float64)
    return {
        "amount_log": (pl.col("amount") * rate).log1p(),
        "hour": pl.col("event_ts").dt.hour().cast(pl.Int64),
        "weekday": (pl.col("event_ts").dt.weekday() - 1).cast(pl.Int64),
        "epoch_s": pl.col("event_ts").dt.epoch("us").cast(pl.Float64) * _SECONDS_PER_MICROSECOND,
    }


def features(timeline: Timeline) -> tuple[np.ndarray, ...]:
    """(current categorical int64 [N, 5], current numeric float32 [N, 8], history categorical
    int64 [N, K, 2], history numeric float32 [N, K, 4], history mask bool [N, K]): the arguments
    of `RiskModel.forward`. History categoricals are shifted by one: 0 is an empty slot."""
    rows, source, valid, k = timeline.rows, timeline.source, timeline.valid, timeline.k
    category = timeline.column("merchant_category_idx")
    country = timeline.column("country_idx")
    amount_log = timeline.column("amount_log")
    epoch_s = timeline.column("epoch_s")

    filled = valid.sum(axis=1)
    has_history = filled > 0
    lag_category = np.where(valid, category[source] + 1, 0)
    lag_country = np.where(valid, country[source] + 1, 0)
    lag_amount = np.where(valid, amount_log[source], 0.0)
    gaps = np.clip(epoch_s[rows][:, None] - epoch_s[source], 0.0, None)
    lag_delta = np.where(valid, np.log1p(gaps) * _PER_LOG_SECOND, 0.0)

    own_amount, own_country, own_category = amount_log[rows], country[rows], category[rows]
    divisor = np.maximum(filled, 1)
    valid_amounts_max = np.where(valid, lag_amount, -np.inf).max(axis=1)
    same_country = (lag_country == own_country[:, None] + 1) & valid
    same_category = (lag_category == own_category[:, None] + 1) & valid
    current_numeric = {
        "amount_log": own_amount,
        "history_fill": filled * (1.0 / k),
        "amount_vs_history_mean": np.where(has_history, own_amount - lag_amount.sum(axis=1) / divisor, 0.0),
        "amount_vs_history_max": np.where(has_history, own_amount - valid_amounts_max, 0.0),
        "same_country_share": np.where(has_history, same_country.sum(axis=1) / divisor, 0.0),
        "same_category_share": np.where(has_history, same_category.sum(axis=1) / divisor, 0.0),
        "since_previous_log": lag_delta[:, 0],
        "has_history": has_history.astype(np.float64),
    }
    return (
        np.ascontiguousarray(
            np.stack([timeline.column(name)[rows] for name in CURRENT_CATEGORICAL], axis=1).astype(np.int64)
        ),
        np.stack([current_numeric[name] for name in CURRENT_NUMERIC], axis=1).astype(np.float32),
        np.ascontiguousarray(np.stack([lag_category, lag_country], axis=2).astype(np.int64)),
        np.ascontiguousarray(np.stack([lag_amount, lag_delta, same_country, valid], axis=2).astype(np.float32)),
        np.ascontiguousarray(valid),
    )
