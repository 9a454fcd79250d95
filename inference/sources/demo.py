"""The demo: the spec's days written into the landing location, then read like anyone's files."""

from __future__ import annotations

import os
import uuid
from datetime import date
from pathlib import Path

from inference.demo import NoDemo, demo_day
from inference.records import raw_columns
from inference.sources.common import DEFAULT_PATTERN, DEMO_FILE, SourceError, has_scheme, label_column
from inference.sources.files import _Pattern
from inference.spec import DemoSettings, LoadedSpec


def demo_path(location: str | Path, day: date, pattern: str = DEFAULT_PATTERN) -> Path:
    parsed = _Pattern.parse(pattern)
    target = Path(location).expanduser() / parsed.relative(day)
    return target / DEMO_FILE if parsed.is_folder else target


def write_demo_day(
    ls: LoadedSpec, location: str | Path, day: date, settings: DemoSettings, pattern: str = DEFAULT_PATTERN
) -> tuple[Path, bool]:
    """Write the spec's demo day as CSV where `pattern` puts it, unless a file is already there:
    its fields, and its label when the day has one (not the hook's own columns).

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
    try:
        frame = demo_day(ls, day, settings)
    except NoDemo as error:
        raise SourceError(str(error)) from error
    label = label_column(ls)
    frame = frame.select(*raw_columns(ls), *([label] if label in frame.columns else []))
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
