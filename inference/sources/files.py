"""Files in a landing location: one file or folder per day, named by a pattern, on a local
directory or anything fsspec opens; CSV, Parquet or NDJSON."""

from __future__ import annotations

import codecs
import csv
import gzip
import hashlib
import io
import json
import re
import string
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from datetime import date, datetime, timedelta
from pathlib import Path
from typing import Any

import polars as pl
from pydantic_core import from_json

from inference.records import numeric_columns, raw_columns
from inference.sources.common import (
    _DIRECTIVE_REGEX,
    DATA_LOOKING,
    DEFAULT_PATTERN,
    EXTENSIONS,
    GZIP,
    PROBLEM,
    SourceError,
    SourceFormat,
    SourceRead,
    _one_line,
    conform,
    has_scheme,
    id_columns,
    kept_columns,
    label_column,
)
from inference.spec import LoadedSpec

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
    suffixes = [suffix.lower() for suffix in Path(name).suffixes]
    if suffixes and suffixes[-1] == GZIP:
        suffixes.pop()
    return EXTENSIONS.get(suffixes[-1]) if suffixes else None


def _looks_like_data(name: str, fmt: SourceFormat | None) -> bool:
    """Data, by its extensions (`part-0001.csv.zst`); of `fmt` when a format is configured, as a
    folder then holds other files on purpose."""
    suffixes = {suffix.lower() for suffix in Path(name).suffixes}
    if fmt is not None:
        return any(EXTENSIONS[suffix] == fmt for suffix in suffixes & EXTENSIONS.keys())
    return bool(suffixes & DATA_LOOKING)


class FileSource:
    """Files in a landing location: one file or one folder of files per day, named by `pattern`.

    `pattern` is a format string over `date` (a `datetime.date`): `{date:%Y-%m-%d}.csv`,
    `{date:%Y%m%d}.parquet`, `{date:%Y/%m/%d}/` (a folder: every file of the format in it is read,
    in name order). `format` None means: from the file's extension. Each file holds `ls`'s records.
    """

    kind = "files"

    def __init__(
        self, ls: LoadedSpec, location: str, pattern: str = DEFAULT_PATTERN, format: SourceFormat | None = None
    ) -> None:
        self.spec = ls
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
            names = []
            for name in store.files_in(relative):
                if Path(name).name.startswith((".", "_")):
                    continue  # `.part.crc`, `_SUCCESS`: a writer's bookkeeping
                if self._format_for(name, strict=False) is not None:
                    names.append(name)
                elif _looks_like_data(name, self.format):
                    # Passed over, its rows would be missing from the day without a word.
                    raise SourceError(
                        f"{store.display(name)}: a data file of a kind Tandem does not read; "
                        f"write {'/'.join(EXTENSIONS)} files, uncompressed or {GZIP}, or move it out of the folder"
                    )
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
            if name.lower().endswith(GZIP):
                data = gzip.decompress(data.read_bytes() if isinstance(data, Path) else data)
            if fmt == "csv":
                # Every column as text: a bad cell becomes one quarantined row, not a failed day.
                try:
                    frame = _without_blank_lines(pl.read_csv(data, infer_schema=False))
                except pl.exceptions.ComputeError:
                    # A line polars cannot take (more fields than the header, bytes that are not
                    # UTF-8) fails the whole read: read again line by line, so it is one bad row.
                    # Not `truncate_ragged_lines` or `encoding="utf8-lossy"`: they alter the row
                    # silently, and the altered row would be scored.
                    frame, problems = _read_csv_by_line(self.spec, data)
                    return _with_problems(conform(self.spec, frame, where, typed=False), problems)
            elif fmt == "parquet":
                frame = pl.read_parquet(data)
            else:
                frame, problems = _read_ndjson(self.spec, data)
                return _with_problems(conform(self.spec, frame, where, typed=False), problems)
        except (pl.exceptions.PolarsError, OSError, EOFError, zlib.error, ValueError, csv.Error) as error:
            raise SourceError(f"{where}: cannot be read as {fmt}: {_one_line(error)}") from error
        return conform(self.spec, frame, where, typed=fmt != "csv")


# ---------------------------------------------------------------------------------------------
# CSV, line by line, for a file polars refuses as a whole.


def _read_csv_by_line(ls: LoadedSpec, data: Any) -> tuple[pl.DataFrame, list[str | None]]:
    """Every cell as text, as `pl.read_csv(infer_schema=False)` reads it (an empty cell is null, a
    short line is padded with nulls), and for each row why it could not be read as written, or
    None. A line with more cells than the header has no reliable cells: all are null. A cell that
    is not UTF-8 is null; the detail keeps its bytes, escaped."""
    raw = data.read_bytes() if isinstance(data, Path) else bytes(data)
    # surrogateescape keeps each undecodable byte recognisable in the cell it belongs to.
    text = raw.decode("utf-8-sig", errors="surrogateescape")
    reader = csv.reader(io.StringIO(text, newline=""), strict=True)
    header = next(reader, [])
    fields = raw_columns(ls)
    columns: list[list[str | None]] = [[] for _ in header]
    problems: list[str | None] = []
    for cells in reader:
        if not any(cell.strip() for cell in cells):
            continue  # a blank line, as `_without_blank_lines` drops it from polars' read
        problem = None
        if len(cells) > len(header):
            problem = f"line {reader.line_num}: {len(cells)} cells, the header has {len(header)}"
            values: list[str | None] = [None] * len(header)
        else:
            values = [cell or None for cell in cells] + [None] * (len(header) - len(cells))
            undecodable = [i for i, cell in enumerate(cells) if _SURROGATE.search(cell)]
            for i in undecodable:
                values[i] = None
            # In a column the record is not made of (an extra one, the label), a null costs nothing.
            named = ", ".join(header[i].strip() for i in undecodable if header[i].strip() in fields)
            if named:
                problem = f"line {reader.line_num}: not UTF-8 in {named}"
        if problem is not None:
            written = ",".join(cells).encode("utf-8", errors="surrogateescape")
            problem = f"{problem}: {_excerpt(written)}"
        for column, value in zip(columns, values, strict=True):
            column.append(value)
        problems.append(problem)
    names = _unique(header)
    frame = pl.DataFrame(dict(zip(names, columns, strict=True)), schema=dict.fromkeys(names, pl.String()))
    return frame, problems


_SURROGATE = re.compile("[\udc80-\udcff]")


def _without_blank_lines(frame: pl.DataFrame) -> pl.DataFrame:
    """The rows with a value in some cell. polars reads a blank line (one that editors and
    spreadsheet exports leave at the end, or a line of bare separators) as a row of nulls, which
    would be quarantined as a record and count against the day's reject rate."""
    blank = pl.all_horizontal(pl.all().str.strip_chars().fill_null("") == "")
    return frame.filter(~blank) if frame.width else frame


def _unique(header: list[str]) -> list[str]:
    """polars' names for a header that repeats a name (`_named` tells the file's error from that)."""
    seen: dict[str, int] = {}
    names = []
    for name in header:
        if name in seen:
            seen[name] += 1
            names.append(f"{name}_duplicated_{seen[name] - 1}")
        else:
            seen[name] = 1
            names.append(name)
    return names


# ---------------------------------------------------------------------------------------------
# NDJSON: each line parsed by Python's json, so every value arrives as written. polars' reader
# types a column from all its lines: one `"12.5"` among numbers failed the day, and a `false` or
# `5411` among category names came back as the text "false" or "5411", which was then scored
# (a request with the same record is refused 422). An all-String polars schema stringifies alike.

_EXCERPT = 200  # characters of an unreadable line kept in its detail


def _lines(data: Any) -> Iterator[bytes]:
    if isinstance(data, Path):
        with data.open("rb") as handle:  # line by line: the file is never in memory twice
            yield from handle
    else:
        yield from io.BytesIO(data)


@dataclass(frozen=True)
class _Names:
    """The spec's columns by what NDJSON reading does with their values."""

    kept: frozenset[str]
    numerics: frozenset[str]
    ids: frozenset[str]
    label: str | None

    @classmethod
    def of(cls, ls: LoadedSpec) -> _Names:
        return cls(
            frozenset(kept_columns(ls)), frozenset(numeric_columns(ls)), frozenset(id_columns(ls)), label_column(ls)
        )


def _read_ndjson(ls: LoadedSpec, data: Any) -> tuple[pl.DataFrame, list[str | None]]:
    """The file's fields and label as text (conform parses them as a CSV's cells), and for each
    row why it could not be read as written, or None. A text field that cannot be read is null in
    the frame and a numeric is its JSON text, so validation alone refuses its row too; its detail
    keeps what was written."""
    names = _Names.of(ls)
    columns: dict[str, list[str | None]] = {}  # each kept key as written: its value on every row
    fields: dict[str, str | None] = {}  # each key seen: the field it names, or None (ignored)
    problems: list[str | None] = []
    for number, read in enumerate(_lines(data), start=1):
        line = read.removeprefix(codecs.BOM_UTF8) if number == 1 else read  # what Windows tools write first
        if not line.strip():
            continue
        filled = 0
        try:
            # pydantic's Rust parser: twice as fast as `json`, and it refuses a lone surrogate
            # (`"\ud800"`), which no database text can hold. NaN, Infinity and 1e999 are read as
            # the user's numbers, for validation to refuse.
            record = from_json(line, allow_inf_nan=True)
        except ValueError as error:
            problems.append(f"line {number}: {_unreadable(line, error)}: {_excerpt(line)}")
        else:
            if isinstance(record, dict):
                wrong = []
                for key, value in record.items():
                    name = fields.get(key, "")
                    if name == "":
                        name = fields[key] = key.strip() if key.strip() in names.kept else None
                    if name is None:
                        continue
                    column = columns.get(key)
                    if column is None:
                        column = columns[key] = [None] * len(problems)
                    filled += 1
                    if type(value) is str and name not in names.numerics:  # nearly every value: no call
                        column.append(value)
                        continue
                    text, expected = _as_text(names, name, value)
                    column.append(text)
                    if expected is not None:
                        # Each line its own row's problem, even when every line has it (epoch times):
                        # a file-wide error would fail a one-line correction file for what is one
                        # quarantined row in a larger file. All rows refused, the reject rate blocks.
                        wrong.append(f"{name}: {json.dumps(value)[:_EXCERPT]} is a JSON {_kind(value)}, not {expected}")
                problems.append(f"line {number}: {'; '.join(wrong)}" if wrong else None)
            else:
                problems.append(f"line {number}: a JSON {_kind(record)}, not an object: {_excerpt(line)}")
        if filled < len(columns):
            for column in columns.values():
                if len(column) < len(problems):
                    column.append(None)
    if problems and not columns and all(problems):
        raise ValueError(problems[0])  # not one line of JSON objects: not an NDJSON file at all
    return pl.DataFrame(columns, schema=dict.fromkeys(columns, pl.String())), problems


def _as_text(names: _Names, name: str, value: Any) -> tuple[str | None, str | None]:
    """(the value as conform reads a CSV cell, or None with what was expected instead)."""
    numeric = name in names.numerics
    if value is None or (isinstance(value, str) and not numeric):
        return value, None
    if name == names.label and isinstance(value, bool):
        return str(int(value)), None
    number = isinstance(value, int | float) and not isinstance(value, bool)
    # Integer ids are taken as their digits, as from a Parquet integer column.
    if number and (numeric or name == names.label or (name in names.ids and isinstance(value, int))):
        return str(value), None  # a float's str reads back exactly: "12.5", "inf", "nan"
    if name == names.label:
        return None, None  # ground truth, not an input: unknown, as a CSV's "maybe"
    if numeric:
        # As written ('"12.5"', 'true'): no number to conform, so it is the received text its
        # quarantine keeps (`received_{name}`).
        return json.dumps(value, ensure_ascii=False), "a number"
    return None, "text"


def _kind(value: Any) -> str:
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int | float):
        return "number"
    if isinstance(value, str):
        return "string"
    return "array" if isinstance(value, list) else "object" if isinstance(value, dict) else type(value).__name__


def _unreadable(line: bytes, error: ValueError) -> str:
    try:
        line.decode("utf-8")
    except UnicodeDecodeError as undecodable:
        return f"not UTF-8 ({undecodable.reason} at byte {undecodable.start})"
    return f"not JSON ({error})"


def _excerpt(line: bytes) -> str:
    text = line.decode("utf-8", errors="backslashreplace").strip()
    return text if len(text) <= _EXCERPT else f"{text[:_EXCERPT]}..."


def _with_problems(frame: pl.DataFrame, problems: list[str | None]) -> pl.DataFrame:
    if all(problem is None for problem in problems):
        return frame  # a clean day is the raw schema (+ label), as every source hands it
    return frame.with_columns(pl.Series(PROBLEM, problems, dtype=pl.String))
