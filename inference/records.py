"""The transaction record: one schema for frames, one model for a single record, one validator.

Validation never raises for the whole frame: every row gets either no reason (valid) or exactly one
reason code, the first rule it breaks in `REASON_ORDER`, so a quarantine row says why precisely.
"""

from __future__ import annotations

import enum
import functools
import hashlib
import math
import re
from datetime import UTC, datetime
from typing import Any

import polars as pl
from pydantic import BaseModel, ConfigDict, Field, field_validator

# The training vocabularies: the values the model has an embedding row of its own for. A value
# outside them that is well-formed (see the patterns below) is scored through the feature
# pipeline's "unknown" bucket and flagged (`unseen_fields`), never refused: a merchant category
# that appears tomorrow is a drift to watch, not poison.
CURRENCIES: tuple[str, ...] = ("USD", "EUR", "GBP", "JPY", "CHF", "CAD", "AUD", "SEK")
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
MERCHANT_CATEGORIES: tuple[str, ...] = (
    "grocery",
    "restaurant",
    "fuel",
    "pharmacy",
    "clothing",
    "travel",
    "hotel",
    "airline",
    "entertainment",
    "utilities",
    "telecom",
    "insurance",
    "education",
    "health",
    "home_improvement",
    "sporting_goods",
    "electronics",
    "jewelry",
    "gift_cards",
    "crypto_exchange",
    "money_transfer",
    "gambling",
    "subscription",
    "marketplace",
)
COUNTRIES: tuple[str, ...] = (
    "US",
    "CA",
    "MX",
    "GB",
    "IE",
    "FR",
    "DE",
    "NL",
    "BE",
    "ES",
    "IT",
    "PT",
    "CH",
    "AT",
    "SE",
    "NO",
    "DK",
    "FI",
    "PL",
    "JP",
    "AU",
    "NZ",
    "SG",
    "BR",
    "NG",
    "RU",
)
# The fields with a training vocabulary, sorted: the order `unseen_fields` names them in.
VOCABULARY_FIELDS: tuple[str, ...] = ("country", "currency", "merchant_category")
# What a well-formed value looks like, checked alike by `validate()` (polars) and `Transaction`
# (pydantic); both use Rust's regex engine, where `$` is the end of the text (Python's `re` would
# also accept a trailing newline). ISO 4217 / ISO 3166-1 alpha-2 shapes, not their code lists:
# a code issued tomorrow is well-formed.
CURRENCY_PATTERN = r"^[A-Z]{3}$"
COUNTRY_PATTERN = r"^[A-Z]{2}$"
CATEGORY_MAX_LENGTH = 64
# After stripping surrounding whitespace: 1-64 ASCII letters, digits, spaces and `_ - & / .`, room
# for names such as "ev_charging", "Home & Garden" or "b2b/saas", none for markup, quotes,
# control characters or the debris of a mis-split CSV line. ASCII only, so a look-alike Unicode
# letter cannot open a second spelling of one category.
CATEGORY_PATTERN = rf"^[A-Za-z0-9 _&/.-]{{1,{CATEGORY_MAX_LENGTH}}}$"
# RFC 3339 date-time text (a `T`, seconds, and `Z` or a numeric offset), checked alike by both
# validators before their own parsers. Each parser alone takes forms the other refuses: pydantic an
# epoch number or "2026-11-01 12:00:00Z", polars "2026-11-01T1:00:00Z", a leading space or a leap
# second. A record is valid on both paths or on neither. ASCII digits only, and no year 0, which
# polars would parse and Python's datetime cannot hold (Rust's regex has no look-ahead to say it).
EVENT_TIME_PATTERN = (
    r"^([1-9][0-9]{3}|0[1-9][0-9]{2}|00[1-9][0-9]|000[1-9])-[0-9]{2}-[0-9]{2}"
    r"T[0-9]{2}:[0-9]{2}:[0-5][0-9](\.[0-9]+)?([Zz]|[+-][0-9]{2}:?[0-9]{2})$"
)
_EVENT_TIME = re.compile(EVENT_TIME_PATTERN)
# The text fields, kept without surrounding whitespace wherever a record comes in (`Transaction`
# with `str_strip_whitespace`, `raw_frame`, `strip_text_fields`): the stripped value is the one
# stored, hashed and scored, so an id padded in a file is the same transaction as in a request.
STRIPPED_COLUMNS: tuple[str, ...] = ("transaction_id", "account_id", "currency", "merchant_category", "country")
# What pydantic's and polars' strips remove (Rust's `char::is_whitespace`). Python's own `strip()`
# also removes the separators U+001C-U+001F, which the other two keep.
WHITESPACE = "".join(c for c in map(chr, range(0x3001)) if c.isspace() and c not in "\x1c\x1d\x1e\x1f")
# An amount above this is a unit or parsing error upstream, not a purchase.
MAX_PLAUSIBLE_AMOUNT = 1_000_000.0
ID_MAX_LENGTH = 64


class RejectReason(enum.StrEnum):
    """Why a record was quarantined (validation) or failed scoring (model stage)."""

    # A NUL character in a text field: PostgreSQL text cannot hold one, so the record cannot be
    # stored (one such row failed the whole day's COPY, at every retry); online it is a 422.
    NUL_CHARACTER = "nul_character"
    MISSING_FIELD = "missing_field"
    DUPLICATE_ID = "duplicate_id"
    # Malformed, not merely unseen: an unseen well-formed value is scored (see CURRENCIES).
    BAD_CURRENCY = "bad_currency"
    # Text that is no number ("12;50", "12,50"): malformed, where `amount_not_finite` is a number
    # that is NaN or infinite, or no amount at all. Quarantined at ingest with the text received.
    AMOUNT_UNPARSABLE = "amount_unparsable"
    AMOUNT_NOT_FINITE = "amount_not_finite"
    AMOUNT_NEGATIVE = "amount_negative"
    AMOUNT_ABSURD = "amount_absurd"
    MALFORMED_CATEGORY = "malformed_category"
    MALFORMED_COUNTRY = "malformed_country"
    TIMESTAMP_MISSING = "timestamp_missing"
    TIMESTAMP_UNPARSABLE = "timestamp_unparsable"
    MODEL_ERROR = "model_error"
    NONFINITE_SCORE = "nonfinite_score"


# The order rules are checked in, so a row breaking several rules always gets the same reason.
REASON_ORDER: tuple[RejectReason, ...] = (
    RejectReason.NUL_CHARACTER,
    RejectReason.MISSING_FIELD,
    RejectReason.DUPLICATE_ID,
    RejectReason.BAD_CURRENCY,
    RejectReason.AMOUNT_UNPARSABLE,
    RejectReason.AMOUNT_NOT_FINITE,
    RejectReason.AMOUNT_NEGATIVE,
    RejectReason.AMOUNT_ABSURD,
    RejectReason.MALFORMED_CATEGORY,
    RejectReason.MALFORMED_COUNTRY,
    RejectReason.TIMESTAMP_MISSING,
    RejectReason.TIMESTAMP_UNPARSABLE,
)

# Source records as they arrive: event_time stays text because a source may send anything.
RAW_SCHEMA: dict[str, pl.DataType] = {
    "transaction_id": pl.String(),
    "account_id": pl.String(),
    "amount": pl.Float64(),
    "currency": pl.String(),
    "merchant_category": pl.String(),
    "country": pl.String(),
    "event_time": pl.String(),
}
RAW_COLUMNS: tuple[str, ...] = tuple(RAW_SCHEMA)
# A field as its source received it, beside the RAW column that holds it read (stripped, or an
# amount parsed), null where the two agree: a quarantine payload keeps the text the user wrote.
# RECEIVED_AMOUNT is set only on a day with an amount text that is no number, since RAW_SCHEMA's
# float column cannot hold "12;50"; validation names such a row amount_unparsable.
RECEIVED_PREFIX = "received_"
RECEIVED_AMOUNT = f"{RECEIVED_PREFIX}amount"
TEXT_COLUMNS: tuple[str, ...] = tuple(name for name, dtype in RAW_SCHEMA.items() if dtype == pl.String())


def has_nul(value: Any) -> bool:
    """Whether a value, or any text inside it (a request's JSON), holds a NUL character."""
    if isinstance(value, str):
        return "\x00" in value
    if isinstance(value, dict):
        return any(has_nul(k) or has_nul(v) for k, v in value.items())
    if isinstance(value, list):
        return any(has_nul(v) for v in value)
    return False


EVENT_TS_DTYPE = pl.Datetime("us", "UTC")


class Transaction(BaseModel):
    """One record, for the online path: the same field names as the `transactions` table."""

    model_config = ConfigDict(extra="forbid", str_strip_whitespace=True)

    transaction_id: str = Field(min_length=1, max_length=ID_MAX_LENGTH)
    account_id: str = Field(min_length=1, max_length=ID_MAX_LENGTH)
    amount: float = Field(ge=0.0, le=MAX_PLAUSIBLE_AMOUNT, allow_inf_nan=False)
    # Shapes only (see CURRENCY_PATTERN): a value outside the training vocabulary is accepted.
    currency: str = Field(min_length=3, max_length=3, pattern=CURRENCY_PATTERN)
    merchant_category: str = Field(min_length=1, max_length=CATEGORY_MAX_LENGTH, pattern=CATEGORY_PATTERN)
    country: str = Field(min_length=2, max_length=2, pattern=COUNTRY_PATTERN)
    event_time: datetime

    @field_validator("amount", mode="before")
    @classmethod
    def _a_number(cls, value: Any) -> Any:
        # pydantic alone reads true as 1.0; a frame (`raw_frame`, a CSV cell) has no amount there.
        if isinstance(value, bool):
            raise ValueError("amount must be a number, not a boolean")
        # A JSON number, as the schema says and an NDJSON line requires (a string amount is that
        # row's problem). Read leniently, pydantic took "1_000" as 1000 and "１２" as 12, which a CSV
        # cell with the same text is quarantined for.
        if isinstance(value, str):
            raise ValueError("amount must be a number, not a string")
        return value

    @field_validator("event_time", mode="before")
    @classmethod
    def _rfc3339_text(cls, value: Any) -> Any:
        if isinstance(value, datetime):  # a Python caller's own value; a request always sends text
            return value
        # fullmatch: `re`'s `$` alone would also accept a trailing newline, which polars refuses.
        if not isinstance(value, str) or _EVENT_TIME.fullmatch(value) is None:
            raise ValueError("event_time must be RFC 3339 text with seconds and an offset (e.g. 2026-11-01T12:00:00Z)")
        return value

    @field_validator("event_time")
    @classmethod
    def _aware_utc(cls, value: datetime) -> datetime:
        if value.tzinfo is None:
            raise ValueError("event_time must carry a timezone offset (e.g. 2026-11-01T12:00:00Z)")
        try:
            return value.astimezone(UTC)
        except OverflowError:  # not a ValueError: pydantic would let it out of validation as a crash
            raise ValueError("event_time is out of range in UTC (years 1-9999)") from None

    def to_raw(self) -> dict[str, Any]:
        raw = self.model_dump()
        raw["event_time"] = format_event_time(self.event_time)
        return raw


def format_event_time(moment: datetime) -> str:
    """Canonical text form, so the same instant always hashes and sorts the same. Not `strftime`:
    its `%Y` writes the year 1 as "1", which is not RFC 3339."""
    return moment.astimezone(UTC).isoformat(timespec="microseconds").removesuffix("+00:00") + "Z"


def empty_raw_frame() -> pl.DataFrame:
    return pl.DataFrame(schema=RAW_SCHEMA)


def raw_frame(records: list[dict[str, Any]]) -> pl.DataFrame:
    """Build a frame in RAW_SCHEMA from dicts without letting one odd value fail the frame."""
    columns: dict[str, list[Any]] = {name: [] for name in RAW_COLUMNS}
    for record in records:
        for name in RAW_COLUMNS:
            columns[name].append(record.get(name))
    columns["amount"] = [_as_float(value) for value in columns["amount"]]
    for name in RAW_COLUMNS:
        if name != "amount":
            columns[name] = [None if value is None else str(value) for value in columns[name]]
    for name in STRIPPED_COLUMNS:
        columns[name] = [None if value is None else value.strip(WHITESPACE) for value in columns[name]]
    return pl.DataFrame(columns, schema=RAW_SCHEMA)


def strip_text_fields(frame: pl.DataFrame) -> pl.DataFrame:
    """`frame` with its text fields stripped, as a request's are (`STRIPPED_COLUMNS`)."""
    return frame.with_columns(pl.col(STRIPPED_COLUMNS).str.strip_chars())


def received_columns(records: list[dict[str, Any]]) -> list[pl.Series]:
    """The fields `raw_frame(records)` does not hold as received (text it strips, an amount text
    that is no number), as RECEIVED_PREFIX columns: the text on rows where it differs, else null.
    Only the columns with such a row."""
    columns = []
    for name in (*STRIPPED_COLUMNS, "amount"):
        values = [record.get(name) for record in records]
        if name == "amount":
            received = [value if _read_amount(value)[1] else None for value in values]
        else:
            received = [
                value if isinstance(value, str) and value.strip(WHITESPACE) != value else None for value in values
            ]
        if any(value is not None for value in received):
            columns.append(pl.Series(f"{RECEIVED_PREFIX}{name}", received, dtype=pl.String))
    return columns


def _as_float(value: Any) -> float | None:
    return _read_amount(value)[0]


def _read_amount(value: Any) -> tuple[float | None, bool]:
    """(the amount, NaN when it is no number; whether it was text that is no number)."""
    if value is None or isinstance(value, bool):
        return None, False
    if isinstance(value, str):
        # Read as a CSV cell is (polars' cast after a strip): ASCII digits, sign, point, exponent.
        # Python's float() alone also reads "1_000" as 1000 and "١٢" or "１２" as 12, which a file
        # with the same text quarantines: one record would mean two things.
        value = value.strip(WHITESPACE)
        if not value:
            return None, False  # a blank cell is no amount, as in a CSV
        if not value.isascii() or "_" in value:
            return math.nan, True
    try:
        return float(value), False
    except (TypeError, ValueError, OverflowError):  # OverflowError: an integer beyond float range
        return math.nan, isinstance(value, str)


# Every eager polars operation is a query of its own, with a fixed cost (about 0.1 ms on this
# project's 2-core machine) that is more than the work for one online record. So a chain of
# operations is one lazy query, run as polars runs its eager operations: on the in-memory engine
# with only expression simplification. (The lazy defaults, engine "auto" and every optimisation,
# cost three times as much on a one-row frame.)
_IN_MEMORY_QUERY = pl.QueryOptFlags.none(simplify_expression=True)


def run_query(query: pl.LazyFrame) -> pl.DataFrame:
    """Collect a query built from in-memory frames, the way eager operations run, but once."""
    return query.collect(engine="in-memory", optimizations=_IN_MEMORY_QUERY)


def _to_utc(column: pl.Expr) -> pl.Expr:
    """Whatever polars' parser reads as a time with an offset, in UTC; else null."""
    return column.str.to_datetime(format="%Y-%m-%dT%H:%M:%S%.f%#z", strict=False, time_unit="us", time_zone="UTC")


def parse_event_time(column: pl.Expr) -> pl.Expr:
    """RFC 3339 text (`EVENT_TIME_PATTERN`) to UTC datetime; anything else becomes null."""
    return pl.when(column.str.contains(EVENT_TIME_PATTERN)).then(_to_utc(column))


def validate(frame: pl.DataFrame) -> pl.DataFrame:
    """Return `frame` plus `event_ts` (parsed) and `reject_reason` (null if valid).

    `frame` needs the RAW_SCHEMA columns; any others (labels, partition keys, RECEIVED_AMOUNT) are
    carried along.

    Duplicated ids: the first occurrence is kept, every later one is rejected, so a frame's valid
    rows always have unique ids.
    """
    return run_query(
        frame.lazy()
        .with_columns(event_ts=parse_event_time(pl.col("event_time")))
        # Years 1-9999 in UTC, as `Transaction` checks: "0001-01-01T00:00:00+01:00" parses to the
        # year 0, which no Python datetime holds (a rejected row is read as one, for its detail).
        # A stage of its own: in `parse_event_time` the parse would run twice, and beside the
        # reason a second output costs an online batch more than this stage does.
        .with_columns(event_ts=pl.when(pl.col("event_ts").dt.year().is_between(1, 9999)).then(pl.col("event_ts")))
        .with_columns(reject_reason=_reject_reason(RECEIVED_AMOUNT in frame.columns))
    )


@functools.cache
def _reject_reason(amount_received: bool) -> pl.Expr:
    """validate()'s rules as one expression, built once: building it cost a sixth of validating
    one online batch. Polars expressions are immutable, so every caller may share it."""
    amount = pl.col("amount")
    unparsable = pl.col(RECEIVED_AMOUNT).is_not_null() if amount_received else pl.lit(False)
    rules: dict[RejectReason, pl.Expr] = {
        RejectReason.NUL_CHARACTER: pl.any_horizontal(
            pl.col(name).str.contains("\x00", literal=True).fill_null(False) for name in TEXT_COLUMNS
        ),
        RejectReason.MISSING_FIELD: pl.col("transaction_id").is_null()
        | pl.col("account_id").is_null()
        # Blank ids count as missing, as `Transaction` (which strips whitespace) treats them.
        | (pl.col("transaction_id").str.strip_chars().str.len_chars() == 0)
        | (pl.col("account_id").str.strip_chars().str.len_chars() == 0)
        | (pl.col("transaction_id").str.len_chars() > ID_MAX_LENGTH)
        | (pl.col("account_id").str.len_chars() > ID_MAX_LENGTH),
        # The first occurrence stays valid. Not a window (`int_range().over()`): that cost a
        # quarter of validating one online batch.
        RejectReason.DUPLICATE_ID: pl.col("transaction_id").is_not_null()
        & ~pl.col("transaction_id").is_first_distinct(),
        RejectReason.BAD_CURRENCY: ~pl.col("currency").str.contains(CURRENCY_PATTERN).fill_null(False),
        RejectReason.AMOUNT_UNPARSABLE: unparsable,
        RejectReason.AMOUNT_NOT_FINITE: amount.is_null() | ~amount.is_finite().fill_null(False),
        RejectReason.AMOUNT_NEGATIVE: amount < 0,
        RejectReason.AMOUNT_ABSURD: amount > MAX_PLAUSIBLE_AMOUNT,
        # Stripped first, as `Transaction` (str_strip_whitespace) does: the same values pass both.
        RejectReason.MALFORMED_CATEGORY: ~pl.col("merchant_category")
        .str.strip_chars()
        .str.contains(CATEGORY_PATTERN)
        .fill_null(False),
        RejectReason.MALFORMED_COUNTRY: ~pl.col("country").str.contains(COUNTRY_PATTERN).fill_null(False),
        RejectReason.TIMESTAMP_MISSING: pl.col("event_time").is_null() | (pl.col("event_time").str.strip_chars() == ""),
        RejectReason.TIMESTAMP_UNPARSABLE: pl.col("event_ts").is_null(),
    }
    reason: pl.Expr = pl.lit(None, dtype=pl.String)
    for code in reversed(REASON_ORDER):
        reason = pl.when(rules[code].fill_null(False)).then(pl.lit(code.value)).otherwise(reason)
    return reason


def split_valid(frame: pl.DataFrame) -> tuple[pl.DataFrame, pl.DataFrame]:
    """(valid rows with event_ts, rejected rows with reject_reason) from a RAW_SCHEMA frame."""
    checked = validate(frame)
    valid = checked.filter(pl.col("reject_reason").is_null()).drop("reject_reason")
    rejected = checked.filter(pl.col("reject_reason").is_not_null())
    return valid, rejected


@functools.cache
def input_hash_expr() -> pl.Expr:
    """The canonical text of a record's RAW contents, hashed by `hash_inputs`.

    Timestamps that parse are hashed in canonical form, so `...Z` and `...+00:00` are one input.
    """
    # The parser alone, without the pattern: a valid row's time matches it anyway, so its hash is
    # the same, and hashing (on every online batch, beside `validate`) does not run the check again.
    parsed = _to_utc(pl.col("event_time"))
    event = (
        pl.when(parsed.is_not_null()).then(parsed.dt.strftime("%Y-%m-%dT%H:%M:%S.%6fZ")).otherwise(pl.col("event_time"))
    )
    return pl.concat_str(
        [
            pl.col("transaction_id").fill_null("\\N"),
            pl.col("account_id").fill_null("\\N"),
            # SQLite stores NaN as NULL; hashing both alike keeps a stored row's hash equal to the source's.
            pl.col("amount").fill_nan(None).cast(pl.String).fill_null("\\N"),
            pl.col("currency").fill_null("\\N"),
            pl.col("merchant_category").fill_null("\\N"),
            pl.col("country").fill_null("\\N"),
            event.fill_null("\\N"),
        ],
        separator="\x1f",
    )


def hash_inputs(frame: pl.DataFrame) -> pl.Series:
    """sha256 of each row's canonical contents; polars' own hash is not stable across versions."""
    canonical = frame.select(input_hash_expr().alias("canonical"))["canonical"]
    return pl.Series(
        "input_hash",
        [hashlib.sha256(text.encode()).hexdigest()[:32] for text in canonical.to_list()],
        dtype=pl.String,
    )
