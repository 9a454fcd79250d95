"""Where a day's source records come from: files in a landing location, or a SQL query.

Every source hands back one day as a frame in RAW_SCHEMA (plus `label_fraud` when it has one).
Row-level problems (an amount that is not a number, a bad timestamp) stay in the frame, so
validation quarantines those rows alone; only a problem with the whole day (no file, a missing or
wrongly typed column, an unreadable file) raises `SourceError`, in one line naming the file, the
column and the problem. The demo generator writes its days as CSV files into the landing location
(`write_demo_day`), so the demo takes the same path as a user's data.
"""

from __future__ import annotations

import hashlib
import math
import os
import re
import string
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, date, datetime, timedelta
from pathlib import Path
from typing import Any, Literal, Protocol

import polars as pl
import sqlalchemy as sa

from inference.demo import DemoConfig, generate_day
from inference.records import RAW_COLUMNS, RAW_SCHEMA, format_event_time, raw_frame

SourceFormat = Literal["parquet", "csv", "ndjson"]
DEFAULT_PATTERN = "{date:%Y-%m-%d}.csv"
LABEL = "label_fraud"
EXTENSIONS: dict[str, SourceFormat] = {
    ".parquet": "parquet",
    ".pq": "parquet",
    ".csv": "csv",
    ".ndjson": "ndjson",
    ".jsonl": "ndjson",
}
DEMO_FILE = "demo.csv"  # the demo's file name inside a day folder (a pattern ending in "/")
CANONICAL_EVENT_TIME = "%Y-%m-%dT%H:%M:%S.%6fZ"
_ID_COLUMNS = ("transaction_id", "account_id")

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


class TransactionSource(Protocol):
    def records_for(self, day: date) -> pl.DataFrame:
        """One UTC day's records in RAW_SCHEMA (plus `label_fraud` Int16 when the source has it)."""
        ...


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
# The pattern: one file or folder per day, named by a format string over `date`.


@dataclass(frozen=True)
class _Pattern:
    text: str
    regex: re.Pattern[str]
    glob: str
    specs: tuple[str, ...]

    @classmethod
    def parse(cls, text: str) -> _Pattern:
        regex, glob, specs = "", "", []
        try:
            pieces = list(string.Formatter().parse(text))
        except ValueError as error:
            raise SourceError(f"pattern {text!r}: {error}") from error
        for literal, field, format_spec, conversion in pieces:
            regex += re.escape(literal)
            glob += re.sub(r"([*?\[])", r"[\1]", literal)
            if field is None:
                continue
            if field != "date" or conversion:
                raise SourceError(f"pattern {text!r}: only {{date}} or {{date:FORMAT}} may be used, found {{{field}}}")
            spec = format_spec or "%Y-%m-%d"  # str(date) is its ISO form
            directive_regex = ""
            for chunk, directive in re.findall(r"([^%]*)(?:%(.))?", spec):
                directive_regex += re.escape(chunk)
                glob += re.sub(r"([*?\[])", r"[\1]", chunk)
                if not directive:
                    continue
                if directive not in _DIRECTIVE_REGEX:
                    supported = " ".join(f"%{d}" for d in _DIRECTIVE_REGEX)
                    raise SourceError(f"pattern {text!r}: %{directive} is not supported (use {supported})")
                directive_regex += _DIRECTIVE_REGEX[directive]
                glob += "%" if directive == "%" else "*"
            regex += f"({directive_regex})"
            specs.append(spec)
        joined = "".join(specs)
        if ("%Y" not in joined and "%y" not in joined) or not ("%j" in joined or ("%d" in joined and "%m" in joined)):
            raise SourceError(f"pattern {text!r} must name the year, month and day, e.g. {DEFAULT_PATTERN}")
        stripped = regex.removesuffix("/")
        # "**" means "any depth" to a glob; `{date:%Y%m%d}` is one path component.
        return cls(text, re.compile(f"^{stripped}$"), re.sub(r"\*+", "*", glob).rstrip("/"), tuple(specs))

    @property
    def is_folder(self) -> bool:
        return self.text.endswith("/")

    def relative(self, day: date) -> str:
        return self.text.format(date=day).rstrip("/")

    def day_of(self, relative: str) -> date | None:
        """The day a path names, or None; a path only counts if the pattern would write it back."""
        match = self.regex.match(relative)
        if match is None:
            return None
        parts: dict[str, int] = {}
        try:
            for spec, text in zip(self.specs, match.groups(), strict=True):
                parsed = datetime.strptime(text, spec)
                if "%Y" in spec or "%y" in spec:
                    parts["year"] = parsed.year
                if "%m" in spec or "%b" in spec or "%B" in spec:
                    parts["month"] = parsed.month
                if "%d" in spec:
                    parts["day"] = parsed.day
                if "%j" in spec:
                    parts["yday"] = parsed.timetuple().tm_yday
            if "month" in parts and "day" in parts:
                day = date(parts["year"], parts["month"], parts["day"])
            else:
                day = date(parts["year"], 1, 1) + timedelta(days=parts["yday"] - 1)
        except (ValueError, KeyError):
            return None
        return day if self.relative(day) == relative else None


# ---------------------------------------------------------------------------------------------
# Storage: a local directory (pathlib) or anything fsspec can open (s3://, gs://, memory://, ...).


class _Local:
    def __init__(self, location: str) -> None:
        self.root = Path(location).expanduser()

    def display(self, relative: str) -> str:
        return str(self.root / relative)

    def exists(self) -> bool:
        return self.root.is_dir()

    def glob(self, pattern: str) -> list[str]:
        return [path.relative_to(self.root).as_posix() for path in self.root.glob(pattern)]

    def is_dir(self, relative: str) -> bool:
        return (self.root / relative).is_dir()

    def is_file(self, relative: str) -> bool:
        return (self.root / relative).is_file()

    def files_in(self, relative: str) -> list[str]:
        folder = self.root / relative
        return [f"{relative}/{path.name}" for path in folder.iterdir() if path.is_file()]

    def token(self, relative: str) -> str:
        stat = (self.root / relative).stat()
        return f"{stat.st_size}:{stat.st_mtime_ns}"

    def source(self, relative: str) -> Any:
        return self.root / relative  # polars reads (and memory-maps) a local path itself


class _Remote:
    def __init__(self, location: str) -> None:
        import fsspec  # only object-store users need it

        self.fs, root = fsspec.core.url_to_fs(location)
        self.root = root.rstrip("/")
        self.location = location.rstrip("/")

    def _path(self, relative: str) -> str:
        return f"{self.root}/{relative}"

    def display(self, relative: str) -> str:
        return f"{self.location}/{relative}"  # as the user wrote the location

    def exists(self) -> bool:
        return bool(self.fs.exists(self.root))

    def glob(self, pattern: str) -> list[str]:
        prefix = f"{self.root}/"
        return [str(path).removeprefix(prefix) for path in self.fs.glob(self._path(pattern))]

    def is_dir(self, relative: str) -> bool:
        return bool(self.fs.isdir(self._path(relative)))

    def is_file(self, relative: str) -> bool:
        return bool(self.fs.isfile(self._path(relative)))

    def files_in(self, relative: str) -> list[str]:
        prefix = f"{self.root}/"
        entries = self.fs.ls(self._path(relative), detail=True)
        return [str(e["name"]).removeprefix(prefix) for e in entries if e.get("type") == "file"]

    def token(self, relative: str) -> str:
        info = self.fs.info(self._path(relative))
        for key in ("ETag", "etag", "md5Hash", "checksum"):
            if info.get(key):
                return f"etag:{info[key]}"
        moment = next(
            (info[k] for k in ("mtime", "LastModified", "last_modified", "updated", "created") if k in info), ""
        )
        return f"{info.get('size')}:{moment}"

    def source(self, relative: str) -> Any:
        with self.fs.open(self._path(relative), "rb") as handle:
            return handle.read()


def _format_of(name: str) -> SourceFormat | None:
    return EXTENSIONS.get(Path(name).suffix.lower())


class FileSource:
    """Files in a landing location: one file or one folder of files per day, named by `pattern`.

    `pattern` is a format string over `date` (a `datetime.date`): `{date:%Y-%m-%d}.csv`,
    `{date:%Y%m%d}.parquet`, `{date:%Y/%m/%d}/` (a folder: every file of the format in it is read,
    in name order). `format` None means: from the file's extension.
    """

    kind = "files"

    def __init__(self, location: str, pattern: str = DEFAULT_PATTERN, format: SourceFormat | None = None) -> None:
        self.location = location
        self.pattern = _Pattern.parse(pattern)
        self.format = format
        self._store: _Local | _Remote = _Remote(location) if has_scheme(location) else _Local(location)

    def __repr__(self) -> str:
        return f"FileSource({self.location!r}, {self.pattern.text!r}, {self.format!r})"

    def files_for(self, day: date) -> list[str]:
        """The day's files, relative to the location, in read order."""
        relative = self.pattern.relative(day)
        store = self._store
        if self.pattern.is_folder or store.is_dir(relative):
            if not store.is_dir(relative):
                raise SourceError(f"no folder for {day} at {store.display(relative)}")
            names = [
                name
                for name in store.files_in(relative)
                if not Path(name).name.startswith((".", "_")) and self._format_for(name, strict=False) is not None
            ]
            if not names:
                wanted = self.format or "/".join(sorted(set(EXTENSIONS.values())))
                raise SourceError(f"{store.display(relative)}: no {wanted} files in the folder for {day}")
            return sorted(names)
        if not store.is_file(relative):
            raise SourceError(f"no file for {day} at {store.display(relative)}")
        return [relative]

    def version_of(self, files: Sequence[str]) -> str:
        """Stable while the files stay as they are: name, size and mtime (or the store's etag)."""
        digest = hashlib.sha256()
        for name in files:
            digest.update(f"{name}\0{self._store.token(name)}\n".encode())
        return digest.hexdigest()[:16]

    def versions(self) -> dict[date, str]:
        """{day: version} for every day present in the location (for the landing sensor)."""
        if not self._store.exists():
            return {}
        found: dict[date, str] = {}
        for relative in sorted(self._store.glob(self.pattern.glob)):
            day = self.pattern.day_of(relative)
            if day is None or day in found:
                continue
            try:
                found[day] = self.version_of(self.files_for(day))
            except (SourceError, FileNotFoundError):
                continue  # an empty folder, or a file removed while listing: not a day (yet)
        return found

    def list_days(self) -> list[date]:
        return sorted(self.versions())

    def read(self, day: date) -> SourceRead:
        files = self.files_for(day)
        # The version is taken before reading, so what is stored is never older than its version says.
        version = self.version_of(files)
        frames = [self._read_file(name) for name in files]
        frame = frames[0] if len(frames) == 1 else pl.concat(frames, how="diagonal")
        return SourceRead(frame, self.kind, tuple(self._store.display(f) for f in files), version)

    def records_for(self, day: date) -> pl.DataFrame:
        return self.read(day).frame

    def _format_for(self, name: str, *, strict: bool = True) -> SourceFormat | None:
        found = _format_of(name)
        if self.format is not None:
            # In a folder only files of the configured format count; a named day file is read as it.
            return self.format if (strict or found == self.format) else None
        if found is None and strict:
            raise SourceError(
                f"{self._store.display(name)}: cannot tell the format from the extension; set TANDEM_SOURCE_FORMAT"
            )
        return found

    def _read_file(self, name: str) -> pl.DataFrame:
        where = self._store.display(name)
        fmt = self._format_for(name)
        try:
            data = self._store.source(name)
            if fmt == "csv":
                # Every column as text: a bad cell becomes one quarantined row, not a failed day.
                frame = pl.read_csv(data, infer_schema=False)
            elif fmt == "parquet":
                frame = pl.read_parquet(data)
            else:
                frame = pl.read_ndjson(data, infer_schema_length=None)
        except (pl.exceptions.PolarsError, OSError, ValueError) as error:
            raise SourceError(f"{where}: cannot be read as {fmt}: {_one_line(error)}") from error
        return conform(frame, where, typed=fmt != "csv")


# ---------------------------------------------------------------------------------------------
# Columns: RAW names required, extra columns ignored, `label_fraud` kept.


def _missing(columns: Iterable[str], where: str) -> None:
    absent = [name for name in RAW_COLUMNS if name not in set(columns)]
    if absent:
        raise SourceError(f"{where}: column {absent[0]!r}: missing (required: {', '.join(RAW_COLUMNS)})")


def conform(frame: pl.DataFrame, where: str, *, typed: bool) -> pl.DataFrame:
    """`frame` in RAW_SCHEMA (+ label_fraud), or SourceError naming `where` and the column.

    `typed` False (CSV): every column is text and amounts are parsed here, a blank one to null and
    an unparsable one to NaN, as `raw_frame` does, so validation rejects that row alone. `typed`
    True (Parquet, NDJSON): a column of the wrong type is the file's error.
    """
    _missing(frame.columns, where)
    exprs = [_column(name, frame.schema[name], where, typed) for name in RAW_COLUMNS]
    if LABEL in frame.columns:
        exprs.append(_label(frame.schema[LABEL], where, typed))
    return frame.select(exprs)


def _wrong(where: str, name: str, expected: str, found: pl.DataType) -> SourceError:
    return SourceError(f"{where}: column {name!r}: expected {expected}, found {found}")


def _column(name: str, dtype: pl.DataType, where: str, typed: bool) -> pl.Expr:
    column = pl.col(name)
    if not typed:
        if name != "amount":
            return column
        text = column.str.strip_chars()
        number = text.cast(pl.Float64, strict=False).fill_null(math.nan)
        return pl.when(text.is_null() | (text == "")).then(None).otherwise(number).alias(name)
    if isinstance(dtype, pl.Null):
        return column.cast(RAW_SCHEMA[name])
    if name == "amount":
        if not dtype.is_numeric():
            raise _wrong(where, name, "a number", dtype)
        return column.cast(pl.Float64)
    if name == "event_time":
        return _event_time(dtype, where)
    if isinstance(dtype, pl.String | pl.Categorical | pl.Enum) or (name in _ID_COLUMNS and dtype.is_integer()):
        return column.cast(pl.String)
    raise _wrong(where, name, "text", dtype)


def _event_time(dtype: pl.DataType, where: str) -> pl.Expr:
    column = pl.col("event_time")
    if isinstance(dtype, pl.String):
        return column
    if not isinstance(dtype, pl.Datetime):
        raise _wrong(where, "event_time", "ISO-8601 text or a timezone-aware timestamp", dtype)
    if dtype.time_zone is None:
        raise SourceError(
            f"{where}: column 'event_time': timestamp without a time zone; "
            "store it timezone-aware or as ISO-8601 text with an offset"
        )
    return column.dt.convert_time_zone("UTC").dt.strftime(CANONICAL_EVENT_TIME)


def _label(dtype: pl.DataType, where: str, typed: bool) -> pl.Expr:
    column = pl.col(LABEL)
    if not typed:
        return column.str.strip_chars().cast(pl.Int16, strict=False)
    if not (dtype.is_integer() or isinstance(dtype, pl.Boolean | pl.Null)):
        raise _wrong(where, LABEL, "0 or 1", dtype)
    return column.cast(pl.Int16)


# ---------------------------------------------------------------------------------------------
# SQL: a query over the partition's time window.


def day_window(day: date) -> tuple[datetime, datetime]:
    """[start, end) of one UTC day."""
    start = datetime(day.year, day.month, day.day, tzinfo=UTC)
    return start, start + timedelta(days=1)


@dataclass(frozen=True)
class SqlSource:
    """Rows of `query` against `url` (any SQLAlchemy URL). The query gets `:start` and `:end`
    (UTC datetimes, [start, end)) and `:day` (the date); it must return the RAW column names."""

    url: str
    query: str
    kind = "sql"

    @property
    def where(self) -> str:
        try:
            return f"query on {sa.engine.make_url(self.url).render_as_string(hide_password=True)}"
        except sa.exc.ArgumentError:
            return "query"

    def read(self, day: date) -> SourceRead:
        start, end = day_window(day)
        try:
            engine = sa.create_engine(self.url)
        except (sa.exc.ArgumentError, ImportError) as error:
            raise SourceError(f"{self.where}: bad database URL: {_one_line(error)}") from error
        try:
            # A connection refused here propagates: it may be transient, the caller's retry policy decides.
            with engine.connect() as conn:
                try:
                    result = conn.execute(sa.text(self.query), {"start": start, "end": end, "day": day})
                    columns = list(result.keys())
                    rows = result.all()
                except sa.exc.StatementError as error:
                    if isinstance(error, sa.exc.DBAPIError) and error.connection_invalidated:
                        raise  # the connection dropped mid-query
                    # On a live connection a failing query is the query's fault (a typo, no such
                    # table): retrying runs the same text again.
                    raise SourceError(f"{self.where}: the query failed: {_one_line(error.orig or error)}") from error
        finally:
            engine.dispose()
        _missing(columns, self.where)
        records = [dict(zip(columns, row, strict=True)) for row in rows]
        labels: list[int | None] = []
        for record in records:
            moment = record["event_time"]
            if isinstance(moment, datetime):
                if moment.tzinfo is None:
                    raise SourceError(
                        f"{self.where}: column 'event_time': timestamp without a time zone; "
                        "return timestamptz or ISO-8601 text with an offset"
                    )
                record["event_time"] = format_event_time(moment)
            if LABEL in columns:
                labels.append(_label_value(record[LABEL]))
        frame = raw_frame(records)
        if LABEL in columns:
            frame = frame.with_columns(pl.Series(LABEL, labels, dtype=pl.Int16))
        return SourceRead(frame, self.kind, (self.where,), None)

    def records_for(self, day: date) -> pl.DataFrame:
        return self.read(day).frame


def _label_value(value: Any) -> int | None:
    if value is None:
        return None
    try:
        return int(value)  # bool, int, Decimal, a whole float, "1"
    except (TypeError, ValueError, OverflowError):
        return None


# ---------------------------------------------------------------------------------------------
# The demo: generated days written into the landing location, then read like anyone's files.


def demo_path(location: str | Path, day: date, pattern: str = DEFAULT_PATTERN) -> Path:
    parsed = _Pattern.parse(pattern)
    target = Path(location).expanduser() / parsed.relative(day)
    return target / DEMO_FILE if parsed.is_folder else target


def write_demo_day(
    location: str | Path, day: date, config: DemoConfig, pattern: str = DEFAULT_PATTERN
) -> tuple[Path, bool]:
    """Write the generated day as CSV where `pattern` puts it, unless a file is already there.

    Returns (path, written). The data is deterministic, so an existing file is the same day; a
    file someone edited is theirs and is kept, like any user's landing file. Written to a temporary
    name first and renamed, so a reader (or the landing sensor) never sees half a file.
    """
    if isinstance(location, str) and has_scheme(location):
        raise SourceError(f"the demo writes to a local directory, not {location}")
    path = demo_path(location, day, pattern)
    if path.exists():
        return path, False
    path.parent.mkdir(parents=True, exist_ok=True)
    frame = generate_day(day, config).drop("poison_kind")
    # Not mkstemp: its file is private (0600); this one gets the umask's mode, like any export.
    temporary = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    try:
        with temporary.open("xb") as handle:
            frame.write_csv(handle)
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    return path, True
