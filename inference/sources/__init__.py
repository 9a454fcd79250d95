"""Where a day's source records come from: files in a landing location, or a SQL query.

Every source reads one spec's records (its `LoadedSpec`, the first argument) and hands back one
day as a frame in its raw schema (plus its label when the source has it). Row-level problems (a
numeric that is not a number, a bad timestamp) stay in the frame, so validation quarantines those
rows alone; only a problem with the whole day (no file, a missing or wrongly typed column, an
unreadable file) raises `SourceError`, in one line naming the file, the column and the problem.
The spec's demo hook writes its days as CSV files into the landing location (`write_demo_day`),
so the demo takes the same path as a user's data.
"""

from __future__ import annotations

from inference.sources.common import (
    DEFAULT_PATTERN,
    RecordSource,
    SourceError,
    SourceFormat,
    SourceRead,
    conform,
    has_scheme,
)
from inference.sources.demo import demo_path, write_demo_day
from inference.sources.files import FileSource
from inference.sources.sql import SqlSource, day_window

__all__ = [
    "DEFAULT_PATTERN",
    "FileSource",
    "RecordSource",
    "SourceError",
    "SourceFormat",
    "SourceRead",
    "SqlSource",
    "conform",
    "day_window",
    "demo_path",
    "has_scheme",
    "write_demo_day",
]
