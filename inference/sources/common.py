"""What every source shares: the day in the spec's raw schema, SourceError, and the column checks
that turn a wrong or missing column into one line naming the file, the column and the problem."""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import date
from typing import Literal, Protocol

import polars as pl

from inference.records import RECEIVED_PREFIX, numeric_columns, raw_columns, raw_schema
from inference.spec import LoadedSpec

SourceFormat = Literal["parquet", "csv", "ndjson"]
DEFAULT_PATTERN = "{date:%Y-%m-%d}.csv"
EXTENSIONS: dict[str, SourceFormat] = {
    ".parquet": "parquet",
    ".pq": "parquet",
    ".csv": "csv",
    ".ndjson": "ndjson",
    ".jsonl": "ndjson",
}
# A compression read transparently after any of EXTENSIONS (`part-0001.csv.gz`, as Spark writes).
GZIP = ".gz"
# Extensions a day folder's data file may carry that Tandem does not read (another compression,
# another format): such a file fails the day by name instead of vanishing from it. A README or a
# `_SUCCESS` marker carries none of them and is passed over.
DATA_LOOKING = frozenset((*EXTENSIONS, ".json", ".tsv", ".avro", ".orc", ".zst", ".bz2", ".xz", ".zip", ".snappy"))
DEMO_FILE = "demo.csv"  # the demo's file name inside a day folder (a pattern ending in "/")
CANONICAL_EVENT_TIME = "%Y-%m-%dT%H:%M:%S.%6fZ"
# The reason of a row its source could not read as written (a line that is not JSON, a JSON
# number or boolean where text belongs); validation's reasons are the spec's codes
# (`inference.spec.validation_order`). Such a row is quarantined at ingest with the why in its
# detail, and never stored or scored.
MALFORMED_ROW = "malformed_row"
# The column a source adds to a day, only when some row of it could not be read: why, naming the
# line, or null for a row read as written. Not a RAW column, so it never reaches the store.
PROBLEM = "source_problem"

# strftime directives a pattern may use, as the text they produce.
_DIRECTIVE_REGEX = {
    "Y": r"\d{4}",
    "y": r"\d{2}",
    "m": r"\d{2}",
    "d": r"\d{2}",
    "j": r"\d{3}",
    "b": r"[A-Za-z]+",
    "B": r"[A-Za-z]+",
    "a": r"[A-Za-z]+",
    "A": r"[A-Za-z]+",
    "%": "%",
}


class SourceError(Exception):
    """A whole source day cannot be read: fail that day's ingest with this message, never retry."""


class RecordSource(Protocol):
    def records_for(self, day: date) -> pl.DataFrame:
        """One UTC day's records in the spec's raw schema (plus its label, Int16, when the source
        has it)."""
        ...


def label_column(ls: LoadedSpec) -> str | None:
    """The label's column, read when a source has it; None: the spec has no label."""
    return ls.label.name if ls.label is not None else None


@functools.cache
def kept_columns(ls: LoadedSpec) -> tuple[str, ...]:
    """The columns a source keeps of what it reads: the fields and the label; others are ignored."""
    label = label_column(ls)
    return (*raw_columns(ls), *([label] if label else []))


@functools.cache
def id_columns(ls: LoadedSpec) -> tuple[str, ...]:
    """The record id and the entity key: an integer there is taken as its digits."""
    return (ls.id.name, *([ls.entity.name] if ls.entity else []))


@dataclass(frozen=True)
class SourceRead:
    """One day as read, with what it was read from, for the ingest's metadata."""

    frame: pl.DataFrame
    kind: str
    paths: tuple[str, ...]
    version: str | None  # files only: changes whenever a file of the day changes


def _one_line(error: BaseException) -> str:
    text = " ".join(str(error).split())
    return text[:300] or type(error).__name__


def has_scheme(location: str) -> bool:
    """`s3://bucket/x` yes; `/data/landing` or `C:\\data` no."""
    return re.match(r"^[A-Za-z][A-Za-z0-9+.-]+://", location) is not None


# ---------------------------------------------------------------------------------------------
# Columns: the fields required, extra columns ignored, the label kept.


def _missing(ls: LoadedSpec, columns: Iterable[str], where: str) -> None:
    names = list(columns)
    present = set(names)
    required = raw_columns(ls)
    absent = [name for name in required if name not in present]
    if absent:
        # A header read as one column holding the separators: the file is not comma-separated.
        hint = next(
            (
                f"; the header reads as one column, {names[0][:80]!r}: CSV is read comma-separated, "
                f"and this looks separated by {separator!r}"
                for separator in (";", "\t", "|")
                if len(names) == 1 and separator in names[0]
            ),
            "",
        )
        raise SourceError(f"{where}: column {absent[0]!r}: missing (required: {', '.join(required)}){hint}")


# polars' name for the second and later columns of a CSV header that repeats a name.
_REPEATED_CSV_NAME = re.compile(r"^(?P<name>.*)_duplicated_\d+$")


def _named(ls: LoadedSpec, frame: pl.DataFrame, where: str) -> pl.DataFrame:
    """Column names without surrounding blanks (`id, price` as written by hand); a required or
    label column given twice is the file's error, since either copy could be the one meant."""
    meant = [name.strip() for name in frame.columns]
    for name in meant:
        match = _REPEATED_CSV_NAME.match(name)
        repeated = match["name"] if match is not None and match["name"] in meant else name
        if repeated in kept_columns(ls) and (repeated != name or meant.count(name) > 1):
            raise SourceError(f"{where}: column {repeated!r}: given more than once")
    if meant == frame.columns:
        return frame
    if len(set(meant)) < len(meant):  # blanks apart, two extra columns share a name: keep the first of each
        keep = [index for index, name in enumerate(meant) if meant.index(name) == index]
        frame, meant = frame[:, keep], [meant[index] for index in keep]
    return frame.rename(dict(zip(frame.columns, meant, strict=True)))


def conform(ls: LoadedSpec, frame: pl.DataFrame, where: str, *, typed: bool) -> pl.DataFrame:
    """`frame` in the spec's raw schema (+ its label), or SourceError naming `where` and the column.

    `typed` False (CSV, NDJSON read as text): every column is text and each numeric is parsed
    here, a blank one to null and an unparsable one to NaN, as `raw_frame` does, its text kept in
    `received_{name}` (only on a day that has one), so validation rejects that row alone and its
    quarantine keeps the text. `typed` True (Parquet): a column of the wrong type is the file's error.
    """
    frame = _named(ls, frame, where)
    _missing(ls, frame.columns, where)
    exprs = [_column(ls, name, frame.schema[name], where, typed) for name in raw_columns(ls)]
    label = label_column(ls)
    if label is not None and label in frame.columns:
        exprs.append(_label(label, frame.schema[label], where, typed))
    if typed:
        return frame.select(exprs)
    received = [_received(name) for name in numeric_columns(ls)]
    read = frame.select(*exprs, *received)
    unused = [column.meta.output_name() for column in received if read[column.meta.output_name()].is_null().all()]
    return read.drop(unused)


def _received(name: str) -> pl.Expr:
    """A numeric's text where it is no number, else null."""
    text = pl.col(name).str.strip_chars()
    unparsable = (text != "") & text.cast(pl.Float64, strict=False).is_null()
    return pl.when(unparsable).then(pl.col(name)).alias(f"{RECEIVED_PREFIX}{name}")


def _wrong(where: str, name: str, expected: str, found: pl.DataType) -> SourceError:
    return SourceError(f"{where}: column {name!r}: expected {expected}, found {found}")


def _column(ls: LoadedSpec, name: str, dtype: pl.DataType, where: str, typed: bool) -> pl.Expr:
    column = pl.col(name)
    numeric = name in numeric_columns(ls)
    if not typed:
        if not numeric:
            return column
        text = column.str.strip_chars()
        number = text.cast(pl.Float64, strict=False).fill_null(math.nan)
        return pl.when(text.is_null() | (text == "")).then(None).otherwise(number).alias(name)
    if isinstance(dtype, pl.Null):
        return column.cast(raw_schema(ls)[name])
    if numeric:
        if not dtype.is_numeric():
            raise _wrong(where, name, "a number", dtype)
        return column.cast(pl.Float64)
    if name == ls.event_time.name:
        return _event_time(name, dtype, where)
    if isinstance(dtype, pl.String | pl.Categorical | pl.Enum) or (name in id_columns(ls) and dtype.is_integer()):
        return column.cast(pl.String)
    raise _wrong(where, name, "text", dtype)


def _event_time(name: str, dtype: pl.DataType, where: str) -> pl.Expr:
    column = pl.col(name)
    if isinstance(dtype, pl.String):
        return column
    if not isinstance(dtype, pl.Datetime):
        raise _wrong(where, name, "ISO-8601 text or a timezone-aware timestamp", dtype)
    if dtype.time_zone is None:
        raise SourceError(
            f"{where}: column {name!r}: timestamp without a time zone; "
            "store it timezone-aware or as ISO-8601 text with an offset"
        )
    return column.dt.convert_time_zone("UTC").dt.strftime(CANONICAL_EVENT_TIME)


def _label(name: str, dtype: pl.DataType, where: str, typed: bool) -> pl.Expr:
    """The label as 0 or 1, or null: not known. A label is ground truth, not an input, so any other
    value ("maybe", 7) leaves the record scored and its outcome unknown, never trained on."""
    if not typed:
        number = pl.col(name).str.strip_chars().cast(pl.Float64, strict=False)  # "1" and "1.0" alike
        return pl.when(number.is_in([0.0, 1.0])).then(number.cast(pl.Int16)).alias(name)
    if not (dtype.is_integer() or isinstance(dtype, pl.Boolean | pl.Null)):
        raise _wrong(where, name, "0 or 1", dtype)
    number = pl.col(name).cast(pl.Int64)
    return pl.when(number.is_in([0, 1])).then(number.cast(pl.Int16)).alias(name)
