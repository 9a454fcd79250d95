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

from inference.records import run_query
from inference.spec import load_spec

# The reference's features, over the reference spec's vocabularies (0012 step 4 moves them into the
# spec's own package, with USD_PER_UNIT).
_REFERENCE = load_spec()
CURRENCIES = _REFERENCE.categorical("currency").vocabulary
MERCHANT_CATEGORIES = _REFERENCE.categorical("merchant_category").vocabulary
COUNTRIES = _REFERENCE.categorical("country").vocabulary
# The fields with a training vocabulary, sorted: the order `unseen_fields` names them in.
VOCABULARY_FIELDS: tuple[str, ...] = tuple(sorted(field.name for field in _REFERENCE.categoricals))
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

FEATURE_COLUMNS = ("transaction_id", "account_id", "amount", "currency", "merchant_category", "country", "event_ts")
CURRENT_CATEGORICAL = ("currency_idx", "category_idx", "country_idx", "hour", "weekday")
# A value outside its training vocabulary gets the index len(vocabulary): one "unknown" bucket per
# field, an embedding row the model learns (training masks a share of known values into it), so
# a well-formed value seen for the first time is scored rather than refused or mis-encoded.
UNKNOWN_CURRENCY, UNKNOWN_CATEGORY, UNKNOWN_COUNTRY = len(CURRENCIES), len(MERCHANT_CATEGORIES), len(COUNTRIES)
CURRENT_CATEGORICAL_CARDINALITY = (UNKNOWN_CURRENCY + 1, UNKNOWN_CATEGORY + 1, UNKNOWN_COUNTRY + 1, 24, 7)
# The fields that can be unseen, in VOCABULARY_FIELDS order (that of the `unseen_fields` flag),
# with their column in `current_categorical` and the index of their unknown bucket.
_ENCODED_AS = {
    "country": ("country_idx", UNKNOWN_COUNTRY),
    "currency": ("currency_idx", UNKNOWN_CURRENCY),
    "merchant_category": ("category_idx", UNKNOWN_CATEGORY),
}
UNSEEN_FIELD_COLUMNS: tuple[tuple[str, int, int], ...] = tuple(
    (name, CURRENT_CATEGORICAL.index(_ENCODED_AS[name][0]), _ENCODED_AS[name][1]) for name in VOCABULARY_FIELDS
)
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
# History item categoricals are shifted by one: 0 is the padding slot of an empty history (and the
# unknown bucket of each is its vocabulary's length + 1).
HISTORY_CATEGORICAL_CARDINALITY = (UNKNOWN_CATEGORY + 2, UNKNOWN_COUNTRY + 2)
HISTORY_NUMERIC_WIDTH = 4
# Scales log-seconds (a week is about 13.3) into roughly [0, 1].
LOG_SECONDS_SCALE = 12.0
# Polars divides a column by a scalar either truly or as a multiplication by the reciprocal,
# depending on the column's (chunk) length, so `x / c` can differ in the last bit between a
# partition and a single record. Multiplying by the reciprocal ourselves gives the same bits always.
_PER_LOG_SECOND = 1.0 / LOG_SECONDS_SCALE
_SECONDS_PER_MICROSECOND = 1e-6
# The longest history a model may read (the digest has one weight per lag); settings validate K against it.
MAX_HISTORY_LENGTH = 256
# One odd 64-bit weight per lag, derived from a fixed string so they never change with a library
# version: the digest is stored, and a digest that changed by itself would rewrite every score.
_LAG_WEIGHTS = np.array(
    [
        int.from_bytes(hashlib.sha256(f"tandem-history-lag-{i}".encode()).digest()[:8], "big") | 1
        for i in range(MAX_HISTORY_LENGTH)
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
    """The value's index in `vocabulary`, or len(vocabulary) (the unknown bucket) if not in it."""
    mapping = {value: index for index, value in enumerate(vocabulary)}
    # Stripped as validation and the API's model strip it, so " grocery " in a file is "grocery".
    return pl.col(column).str.strip_chars().replace_strict(mapping, default=len(vocabulary), return_dtype=pl.Int64)


@functools.cache
def _encoded_columns() -> dict[str, pl.Expr]:
    """The encoded columns' expressions, built once (each vocabulary becomes a polars Series, and
    building them cost about a tenth of one online batch's features); expressions are immutable."""
    # An unseen currency has no rate. 1.0 (the amount as if in USD) keeps the feature finite and
    # the record scored; refusing it would be the drift outage this bucket exists to avoid, and a
    # guessed rate would look authoritative. The amount is then not comparable with the account's
    # history, which is why the row carries "currency" in `unseen_fields`.
    rate = pl.col("currency").replace_strict(USD_PER_UNIT, default=1.0, return_dtype=pl.Float64)
    return {
        "amount_log": (pl.col("amount") * rate).log1p(),
        "currency_idx": _index_of("currency", CURRENCIES),
        "category_idx": _index_of("merchant_category", MERCHANT_CATEGORIES),
        "country_idx": _index_of("country", COUNTRIES),
        "hour": pl.col("event_ts").dt.hour().cast(pl.Int64),
        "weekday": (pl.col("event_ts").dt.weekday() - 1).cast(pl.Int64),
        "epoch_s": pl.col("event_ts").dt.epoch("us").cast(pl.Float64) * _SECONDS_PER_MICROSECOND,
    }


def build_features(
    targets: pl.DataFrame, history: pl.DataFrame, history_length: int, *, targets_read_each_other: bool = True
) -> FeatureBatch:
    """Features for every row of `targets` (valid rows: RAW columns plus `event_ts`).

    `history` holds valid rows of the same accounts; it may contain the targets themselves and
    rows after them. A target's history is the `history_length` rows of its account that sort
    before it by (event_ts, transaction_id).

    `targets_read_each_other`: the targets are records of the history too (a stored partition, a
    training set), so an earlier target is history of a later one. False for the online path,
    where the targets are what concurrent requests sent: each target then reads `history` alone,
    so its answer does not depend on what else shared its adaptive batch.

    When both frames carry `input_hash`, each row also gets a digest of the input hashes of the
    records its history was built from, in order: the score depends on them as much as on the
    record itself, so a corrected, late or removed record changes the digest of every later
    record that read it.
    """
    k = history_length
    if not 1 <= k <= MAX_HISTORY_LENGTH:
        raise ValueError(f"history_length {k} outside 1..{MAX_HISTORY_LENGTH}")
    with_digest = "input_hash" in targets.columns and "input_hash" in history.columns
    timeline = _timeline(targets, history, with_digest=with_digest, targets_read_each_other=targets_read_each_other)
    # From here on numpy: a few dozen vectorised operations on the target rows only. The same
    # steps as polars expressions cost ~7 ms of per-expression overhead for a single record.
    target_order = timeline["target_order"].to_numpy()
    rows = np.flatnonzero(target_order >= 0)
    rows = rows[np.argsort(target_order[rows])]  # back to target order
    if rows.size != targets.height:
        # The ids below are the targets' own, so every target must be on the timeline exactly once.
        raise ValueError(f"{rows.size} timeline rows for {targets.height} targets")
    return _features_of_rows(targets["transaction_id"].to_list(), timeline, rows, k, with_digest=with_digest)


def _timeline(
    targets: pl.DataFrame, history: pl.DataFrame, *, with_digest: bool, targets_read_each_other: bool
) -> pl.DataFrame:
    """Targets and their accounts' history rows, encoded and sorted into timelines (one per account,
    or one per target where targets must not read each other); `target_order` is a row's position
    in `targets`, -1 for a history row, and `account_run` numbers the timelines in order."""
    columns = [*FEATURE_COLUMNS, "input_hash"] if with_digest else list(FEATURE_COLUMNS)
    # One lazy query up to the timeline, then numpy: as eager operations, the same steps were a
    # dozen polars queries, each with a fixed cost larger than one online record's work.
    wanted = targets.lazy().select(columns).with_columns(target_position=pl.int_range(pl.len(), dtype=pl.Int64))
    candidates = history.lazy().select(columns).join(wanted.select("account_id").unique(), on="account_id", how="semi")
    if targets_read_each_other or targets["account_id"].n_unique() == targets.height:
        # One timeline per account: targets and history rows together. Targets of distinct
        # accounts never meet on one, so read alone they need no timeline of their own (the common
        # online case); a stored row then gives way only to the same transaction of its own account.
        timeline_key = "account_id"
        superseded = ["transaction_id"] if targets_read_each_other else ["transaction_id", "account_id"]
        past = candidates.join(wanted.select(superseded), on=superseded, how="anti").with_columns(
            target_position=pl.lit(None, dtype=pl.Int64)
        )
        together = pl.concat([wanted, past])
    else:
        # One timeline per target: the target and its account's history rows (at most a few K per
        # target online), never another target; a stored record other than the target itself stays.
        timeline_key = "timeline"
        own = wanted.select("account_id", timeline=pl.col("target_position"), own_id=pl.col("transaction_id"))
        past = (
            candidates.join(own, on="account_id")
            .filter(pl.col("transaction_id") != pl.col("own_id"))
            .select(*columns, target_position=pl.lit(None, dtype=pl.Int64), timeline=pl.col("timeline"))
        )
        together = pl.concat([wanted.with_columns(timeline=pl.col("target_position")), past])
    timeline_query = (
        together.with_columns(**_encoded_columns())
        .sort([timeline_key, "event_ts", "transaction_id"])
        .with_columns(
            account_run=(pl.col(timeline_key) != pl.col(timeline_key).shift(1)).fill_null(True).cum_sum(),
            target_order=pl.col("target_position").fill_null(-1),
        )
    )
    if with_digest:
        # 60 bits of the record's sha256 (hex), enough to tell versions of one record apart.
        timeline_query = timeline_query.with_columns(
            record_number=pl.col("input_hash").str.slice(0, 15).str.to_integer(base=16)
        )
    return run_query(timeline_query)


def _features_of_rows(
    transaction_ids: list[str], timeline: pl.DataFrame, rows: np.ndarray, k: int, *, with_digest: bool
) -> FeatureBatch:
    """The model inputs of the timeline's `rows` (the targets, in their own order), each reading
    up to `k` rows before it on its timeline as history."""
    account = timeline["account_run"].to_numpy()
    category = timeline["category_idx"].to_numpy()
    country = timeline["country_idx"].to_numpy()
    amount_log = timeline["amount_log"].to_numpy()
    epoch_s = timeline["epoch_s"].to_numpy()

    # [n, k] index of each target's b-th predecessor (b = 1..k), and whether it is of the same account.
    back = rows[:, None] - np.arange(1, k + 1)[None, :]
    source = np.maximum(back, 0)
    valid = (back >= 0) & (account[source] == account[rows][:, None])
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
    return FeatureBatch(
        transaction_ids=transaction_ids,
        current_categorical=np.ascontiguousarray(
            np.stack([timeline[name].to_numpy()[rows] for name in CURRENT_CATEGORICAL], axis=1).astype(np.int64)
        ),
        current_numeric=np.stack([current_numeric[name] for name in CURRENT_NUMERIC], axis=1).astype(np.float32),
        history_categorical=np.ascontiguousarray(np.stack([lag_category, lag_country], axis=2).astype(np.int64)),
        history_numeric=np.ascontiguousarray(
            np.stack([lag_amount, lag_delta, same_country, valid], axis=2).astype(np.float32)
        ),
        history_mask=np.ascontiguousarray(valid),
        history_digests=(
            _history_digests(np.where(valid, timeline["record_number"].to_numpy()[source], 0)) if with_digest else None
        ),
    )


# `unseen_fields` text for each combination of unseen fields, indexed by a bitmask whose bit i is
# UNSEEN_FIELD_COLUMNS[i]: a lookup instead of joining strings row by row.
_UNSEEN_TEXT = np.array(
    [
        ",".join(name for bit, (name, _, _) in enumerate(UNSEEN_FIELD_COLUMNS) if mask >> bit & 1) or None
        for mask in range(1 << len(UNSEEN_FIELD_COLUMNS))
    ],
    dtype=object,
)


def unseen_fields(features: FeatureBatch) -> list[str | None]:
    """Per row, the sorted comma-separated fields scored through their unknown bucket, or None."""
    mask = np.zeros(len(features), dtype=np.int64)
    for bit, (_, column, unknown) in enumerate(UNSEEN_FIELD_COLUMNS):
        mask |= (features.current_categorical[:, column] == unknown).astype(np.int64) << bit
    texts: list[str | None] = _UNSEEN_TEXT[mask].tolist()
    return texts


def _history_digests(record_numbers: np.ndarray) -> list[str]:
    """A position-weighted sum of the history records' numbers, modulo 2**64 (numpy's uint64
    arithmetic wraps): vectorised, and with odd weights one changed record always changes it."""
    numbers = record_numbers.astype(np.uint64)
    digests = (numbers * _LAG_WEIGHTS[: numbers.shape[1]]).sum(axis=1, dtype=np.uint64)
    return [f"{value:016x}" for value in digests.tolist()]
