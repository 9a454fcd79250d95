"""A spec's records: their frame schema, their one validator and their input hash.

Everything here reads the record's fields from a `LoadedSpec` (inference.spec): which columns a
frame holds, which text is stripped, which rules a record is checked by. Validation never raises
for the whole frame: every row gets either no reason (valid) or exactly one reason code, the first
rule it breaks in the spec's `validation_order`, so a quarantine row says why precisely.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import operator
import re
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

import polars as pl

from inference.spec import (
    EVENT_TIME_PATTERN,
    Categorical,
    EntityKey,
    GenericReason,
    LoadedSpec,
    RecordId,
    validation_order,
)

# What pydantic's and polars' strips remove (Rust's `char::is_whitespace`). Python's own `strip()`
# also removes the separators U+001C-U+001F, which the other two keep.
WHITESPACE = "".join(c for c in map(chr, range(0x3001)) if c.isspace() and c not in "\x1c\x1d\x1e\x1f")
# A field as its source received it, beside the raw column that holds it read (stripped, or a
# numeric parsed), null where the two agree: a quarantine payload keeps the text the user wrote.
# `received_{numeric}` is set only on a day with a numeric's text that is no number, since the
# raw schema's float column cannot hold "12;50"; validation names such a row `{numeric}_unparsable`.
RECEIVED_PREFIX = "received_"
EVENT_TS_DTYPE = pl.Datetime("us", "UTC")


@functools.cache
def raw_schema(ls: LoadedSpec) -> Mapping[str, pl.DataType]:
    """Source records as they arrive, in field order: numerics as floats, everything else text
    (the event time too, because a source may send anything)."""
    numerics = {field.name for field in ls.numerics}
    return {name: pl.Float64() if name in numerics else pl.String() for name in ls.field_names}


@functools.cache
def raw_columns(ls: LoadedSpec) -> tuple[str, ...]:
    return tuple(raw_schema(ls))


@functools.cache
def text_columns(ls: LoadedSpec) -> tuple[str, ...]:
    return tuple(name for name, dtype in raw_schema(ls).items() if dtype == pl.String())


@functools.cache
def stripped_columns(ls: LoadedSpec) -> tuple[str, ...]:
    """The text fields kept without surrounding whitespace wherever a record comes in (the record
    model with `str_strip_whitespace`, `raw_frame`, `strip_text_fields`): the stripped value is
    the one stored, hashed and scored, so an id padded in a file is the same record as in a
    request. All text but the event time, which is parsed as it came."""
    return tuple(name for name in text_columns(ls) if name != ls.event_time.name)


@functools.cache
def numeric_columns(ls: LoadedSpec) -> tuple[str, ...]:
    return tuple(field.name for field in ls.numerics)


def has_nul(value: Any) -> bool:
    """Whether a value, or any text inside it (a request's JSON), holds a NUL character."""
    if isinstance(value, str):
        return "\x00" in value
    if isinstance(value, dict):
        return any(has_nul(k) or has_nul(v) for k, v in value.items())
    if isinstance(value, list):
        return any(has_nul(v) for v in value)
    return False


def format_event_time(moment: datetime) -> str:
    """Canonical text form, so the same instant always hashes and sorts the same. Not `strftime`:
    its `%Y` writes the year 1 as "1", which is not RFC 3339."""
    return moment.astimezone(UTC).isoformat(timespec="microseconds").removesuffix("+00:00") + "Z"


def empty_raw_frame(ls: LoadedSpec) -> pl.DataFrame:
    return pl.DataFrame(schema=raw_schema(ls))


def raw_frame(ls: LoadedSpec, records: list[dict[str, Any]]) -> pl.DataFrame:
    """Build a frame in the raw schema from dicts without letting one odd value fail the frame."""
    numerics = numeric_columns(ls)
    columns: dict[str, list[Any]] = {}
    for name in raw_columns(ls):
        values = [record.get(name) for record in records]
        if name in numerics:
            columns[name] = [_as_float(value) for value in values]
        else:
            columns[name] = [None if value is None else _as_text(value) for value in values]
    for name in stripped_columns(ls):
        columns[name] = [None if value is None else value.strip(WHITESPACE) for value in columns[name]]
    return pl.DataFrame(columns, schema=raw_schema(ls))


def strip_text_fields(ls: LoadedSpec, frame: pl.DataFrame) -> pl.DataFrame:
    """`frame` with its text fields stripped, as a request's are (`stripped_columns`)."""
    return frame.with_columns(pl.col(stripped_columns(ls)).str.strip_chars())


def received_columns(ls: LoadedSpec, records: list[dict[str, Any]]) -> list[pl.Series]:
    """The fields `raw_frame(ls, records)` does not hold as received (text it strips, a numeric's
    text that is no number), as RECEIVED_PREFIX columns: the text on rows where it differs, else
    null. Only the columns with such a row."""
    columns = []
    numerics = numeric_columns(ls)
    for name in (*stripped_columns(ls), *numerics):
        values = [record.get(name) for record in records]
        if name in numerics:
            received = [_as_text(value) if _read_number(value)[1] else None for value in values]
        else:
            received = [
                value if isinstance(value, str) and value.strip(WHITESPACE) != value else None for value in values
            ]
        if any(value is not None for value in received):
            columns.append(pl.Series(f"{RECEIVED_PREFIX}{name}", received, dtype=pl.String))
    return columns


def _as_text(value: Any) -> str:
    """A value in a text field as its sender wrote it: a request's JSON list, object or boolean as
    JSON (`["US"]`, not Python's `['US']`), anything else as its own text."""
    if isinstance(value, str):
        return value
    if isinstance(value, list | dict | bool):
        return json.dumps(value, ensure_ascii=False, default=str)
    return str(value)


def _as_float(value: Any) -> float | None:
    return _read_number(value)[0]


def _read_number(value: Any) -> tuple[float | None, bool]:
    """(the number, NaN when it is none; whether it was something other than a number: text that
    reads as none, or a request's JSON boolean, list or object)."""
    if value is None:
        return None, False
    if isinstance(value, list | dict | bool):
        return math.nan, True
    if isinstance(value, str):
        # Read as a CSV cell is (polars' cast after a strip): ASCII digits, sign, point, exponent.
        # Python's float() alone also reads "1_000" as 1000 and "١٢" or "１２" as 12, which a file
        # with the same text quarantines: one record would mean two things.
        value = value.strip(WHITESPACE)
        if not value:
            return None, False  # a blank cell is no number, as in a CSV
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


def validate(ls: LoadedSpec, frame: pl.DataFrame) -> pl.DataFrame:
    """Return `frame` plus `event_ts` (parsed) and `reject_reason` (null if valid).

    `frame` needs the raw schema's columns; any others (labels, partition keys, `received_*`) are
    carried along.

    Duplicated ids: the first occurrence is kept, every later one is rejected, so a frame's valid
    rows always have unique ids.
    """
    event_time = pl.col(ls.event_time.name)
    received = frozenset(name for name in numeric_columns(ls) if f"{RECEIVED_PREFIX}{name}" in frame.columns)
    return run_query(
        frame.lazy()
        .with_columns(event_ts=parse_event_time(event_time))
        # Years 1-9999 in UTC, as the record model checks: "0001-01-01T00:00:00+01:00" parses to the
        # year 0, which no Python datetime holds (a rejected row is read as one, for its detail).
        # A stage of its own: in `parse_event_time` the parse would run twice, and beside the
        # reason a second output costs an online batch more than this stage does.
        .with_columns(event_ts=pl.when(pl.col("event_ts").dt.year().is_between(1, 9999)).then(pl.col("event_ts")))
        .with_columns(reject_reason=_reject_reason(ls, received))
    )


def _missing(name: str, max_length: int) -> pl.Expr:
    """Null, blank (the record model strips whitespace) or longer than `max_length`."""
    column = pl.col(name)
    return column.is_null() | (column.str.strip_chars().str.len_chars() == 0) | (column.str.len_chars() > max_length)


# `^[class]{n}$` or `^[class]{min,max}$`: one character class repeated, so its length bounds are
# the repetition's (a class matches one character, as `len_chars` counts them).
_ONE_CLASS = re.compile(r"\^(\[(?:[^\]\\]|\\.)+\])\{(\d+)(?:,(\d+))?\}\$")


def _well_formed(categorical: Categorical) -> pl.Expr:
    """The record model's check of a categorical (stripped, `pattern`, `min_length`..`max_length`),
    with the work a pattern makes needless left out: each step is a cost on every online batch.
    A pattern of one character class that holds no whitespace refuses padding itself (and the
    frames validated are stripped: `raw_frame`, `strip_text_fields`), so it is matched as it
    stands; one whose repetition lies within the bounds needs no length check."""
    shape = _ONE_CLASS.fullmatch(categorical.pattern)
    if shape is None:
        text = pl.col(categorical.name).str.strip_chars()
        bounded = text.str.len_chars().is_between(categorical.min_length, categorical.max_length)
        return text.str.contains(categorical.pattern) & bounded
    character, least, most = shape.group(1), int(shape.group(2)), int(shape.group(3) or shape.group(2))
    padded = pl.Series(list(WHITESPACE), dtype=pl.String).str.contains(f"^{character}$").any()
    text = pl.col(categorical.name).str.strip_chars() if padded else pl.col(categorical.name)
    matches = text.str.contains(categorical.pattern)
    if categorical.min_length <= least and most <= categorical.max_length:
        return matches
    return matches & text.str.len_chars().is_between(categorical.min_length, categorical.max_length)


def _rules(ls: LoadedSpec, received: frozenset[str]) -> dict[str, pl.Expr]:
    """Every code validation checks, with the expression true where a row breaks its rule."""
    record_id, event_time = pl.col(ls.id.name), pl.col(ls.event_time.name)
    keys: list[RecordId | EntityKey] = [ls.id, *([ls.entity] if ls.entity else [])]
    missing = functools.reduce(operator.or_, (_missing(key.name, key.max_length) for key in keys))
    rules: dict[str, pl.Expr] = {
        GenericReason.NUL_CHARACTER: pl.any_horizontal(
            pl.col(name).str.contains("\x00", literal=True).fill_null(False) for name in text_columns(ls)
        ),
        GenericReason.MISSING_FIELD: missing,
        # The first occurrence stays valid. Not a window (`int_range().over()`): that cost a
        # quarter of validating one online batch.
        GenericReason.DUPLICATE_ID: record_id.is_not_null() & ~record_id.is_first_distinct(),
        GenericReason.TIMESTAMP_MISSING: event_time.is_null() | (event_time.str.strip_chars() == ""),
        GenericReason.TIMESTAMP_UNPARSABLE: pl.col("event_ts").is_null(),
    }
    for numeric in ls.numerics:
        value = pl.col(numeric.name)
        received_text = pl.col(f"{RECEIVED_PREFIX}{numeric.name}")
        rules[numeric.unparsable_code] = received_text.is_not_null() if numeric.name in received else pl.lit(False)
        rules[numeric.not_finite_code] = value.is_null() | ~value.is_finite().fill_null(False)
        if numeric.minimum is not None:
            rules[numeric.below_code] = value < numeric.minimum
        if numeric.maximum is not None:
            rules[numeric.above_code] = value > numeric.maximum
    for categorical in ls.categoricals:
        rules[categorical.malformed_code] = ~_well_formed(categorical).fill_null(False)
    for rule in ls.spec.rules:
        rules[rule.code] = rule.refuses()
    return rules


@functools.cache
def _reject_reason(ls: LoadedSpec, received: frozenset[str]) -> pl.Expr:
    """validate()'s rules as one expression, built once per spec: building it cost a sixth of
    validating one online batch. Polars expressions are immutable, so every caller may share it.
    `received`: the numerics whose `received_*` column the frame has."""
    rules = _rules(ls, received)
    reason: pl.Expr = pl.lit(None, dtype=pl.String)
    for code in reversed(validation_order(ls.spec)):
        reason = pl.when(rules[code].fill_null(False)).then(pl.lit(str(code))).otherwise(reason)
    return reason


@functools.cache
def reason_fields(ls: LoadedSpec) -> Mapping[str, tuple[str, ...]]:
    """The fields each validation code is about, for a rejection's detail."""
    keys = (ls.id.name, *([ls.entity.name] if ls.entity else ()))
    fields: dict[str, tuple[str, ...]] = {
        GenericReason.MISSING_FIELD.value: keys,
        GenericReason.DUPLICATE_ID.value: (ls.id.name,),
        GenericReason.TIMESTAMP_MISSING.value: (ls.event_time.name,),
        GenericReason.TIMESTAMP_UNPARSABLE.value: (ls.event_time.name,),
    }
    for numeric in ls.numerics:
        codes = (numeric.unparsable_code, numeric.not_finite_code, numeric.below_code, numeric.above_code)
        fields |= dict.fromkeys(codes, (numeric.name,))
    fields |= {categorical.malformed_code: (categorical.name,) for categorical in ls.categoricals}
    fields |= {rule.code: (rule.field,) for rule in ls.spec.rules}
    return fields


def split_valid(ls: LoadedSpec, frame: pl.DataFrame) -> tuple[pl.DataFrame, pl.DataFrame]:
    """(valid rows with event_ts, rejected rows with reject_reason) from a raw frame."""
    checked = validate(ls, frame)
    valid = checked.filter(pl.col("reject_reason").is_null()).drop("reject_reason")
    rejected = checked.filter(pl.col("reject_reason").is_not_null())
    return valid, rejected


@functools.cache
def input_hash_expr(ls: LoadedSpec) -> pl.Expr:
    """The canonical text of a record's raw contents, hashed by `hash_inputs`: the fields in
    declaration order, `\\x1f`-joined, `\\N` for null.

    Timestamps that parse are hashed in canonical form, so `...Z` and `...+00:00` are one input.
    """
    # The parser alone, without the pattern: a valid row's time matches it anyway, so its hash is
    # the same, and hashing (on every online batch, beside `validate`) does not run the check again.
    event_time = pl.col(ls.event_time.name)
    parsed = _to_utc(event_time)
    event = pl.when(parsed.is_not_null()).then(parsed.dt.strftime("%Y-%m-%dT%H:%M:%S.%6fZ")).otherwise(event_time)
    numerics = numeric_columns(ls)

    def canonical(name: str) -> pl.Expr:
        if name == ls.event_time.name:
            return event.fill_null("\\N")
        if name in numerics:
            # SQLite stores NaN as NULL; hashing both alike keeps a stored row's hash equal to the source's.
            return pl.col(name).fill_nan(None).cast(pl.String).fill_null("\\N")
        return pl.col(name).fill_null("\\N")

    return pl.concat_str([canonical(name) for name in raw_columns(ls)], separator="\x1f")


def hash_inputs(ls: LoadedSpec, frame: pl.DataFrame) -> pl.Series:
    """sha256 of each row's canonical contents; polars' own hash is not stable across versions."""
    canonical = frame.select(input_hash_expr(ls).alias("canonical"))["canonical"]
    return pl.Series(
        "input_hash",
        [hashlib.sha256(text.encode()).hexdigest()[:32] for text in canonical.to_list()],
        dtype=pl.String,
    )
