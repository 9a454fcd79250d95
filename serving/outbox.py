"""A durable local outbox for prediction rows the database could not take.

SQLite in WAL mode with synchronous=FULL: a row is on disk (fsync'd) before `append` returns, and
several worker processes may share the file. Draining upserts a chunk into the database and only
then deletes it locally; a crash in between replays the chunk, which the idempotent upsert absorbs.
"""

from __future__ import annotations

import json
import sqlite3
import threading
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

_SCHEMA = """
CREATE TABLE IF NOT EXISTS outbox (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    row TEXT NOT NULL
)
"""


def _encode(value: Any) -> Any:
    if isinstance(value, datetime):
        return {"__datetime__": value.isoformat()}
    raise TypeError(f"cannot store {type(value).__name__} in the outbox")


def _decode(mapping: dict[str, Any]) -> Any:
    if "__datetime__" in mapping:
        return datetime.fromisoformat(mapping["__datetime__"])
    return mapping


class PartlyWritten(Exception):
    """What a drain's `write` raises when it stopped partway: `unwritten` are the rows (the same
    objects it was handed) still to do; the others were handled and leave the outbox."""

    def __init__(self, unwritten: list[dict[str, Any]]) -> None:
        super().__init__(f"{len(unwritten)} rows not written")
        self.unwritten = unwritten


class Outbox:
    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._lock = threading.Lock()
        self._conn = sqlite3.connect(path, timeout=30, check_same_thread=False, isolation_level=None)
        self._conn.execute("PRAGMA journal_mode=WAL")
        self._conn.execute("PRAGMA synchronous=FULL")
        self._conn.execute(_SCHEMA)

    def append(self, rows: list[dict[str, Any]]) -> None:
        if not rows:
            return
        encoded = [(json.dumps(row, default=_encode, allow_nan=False),) for row in rows]
        with self._lock:
            self._conn.execute("BEGIN IMMEDIATE")
            try:
                self._conn.executemany("INSERT INTO outbox (row) VALUES (?)", encoded)
                self._conn.execute("COMMIT")
            except BaseException:
                self._conn.execute("ROLLBACK")
                raise

    def depth(self) -> int:
        with self._lock:
            return int(self._conn.execute("SELECT count(*) FROM outbox").fetchone()[0])

    def drain(self, write: Callable[[list[dict[str, Any]]], None], chunk: int) -> int:
        """Hand the oldest rows to `write` chunk by chunk until empty or `write` raises; returns rows
        drained. A `PartlyWritten` chunk keeps only its unwritten rows, so none is handled twice."""
        drained = 0
        while True:
            with self._lock:
                found = self._conn.execute("SELECT id, row FROM outbox ORDER BY id LIMIT ?", (chunk,)).fetchall()
            if not found:
                return drained
            rows = [json.loads(text, object_hook=_decode) for _, text in found]
            try:
                write(rows)
            except PartlyWritten as partly:
                left = {id(row) for row in partly.unwritten}
                handled = [(row_id,) for (row_id, _), row in zip(found, rows, strict=True) if id(row) not in left]
                with self._lock:
                    self._conn.executemany("DELETE FROM outbox WHERE id = ?", handled)
                raise
            with self._lock:
                self._conn.execute("DELETE FROM outbox WHERE id <= ?", (found[-1][0],))
            drained += len(found)

    def close(self) -> None:
        with self._lock:
            self._conn.close()
