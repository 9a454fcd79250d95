"""Files in a landing location: one file or folder per day, named by a pattern, on a local
directory or anything fsspec opens; CSV, Parquet or NDJSON."""

from __future__ import annotations

import hashlib
import re
import string
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import date, datetime, timedelta
from pathlib import Path
from typing import Any

import polars as pl

from inference.sources.common import (
    _DIRECTIVE_REGEX,
    DEFAULT_PATTERN,
    EXTENSIONS,
    SourceError,
    SourceFormat,
    SourceRead,
    _one_line,
    conform,
    has_scheme,
)

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
