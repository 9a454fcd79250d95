"""Engines, the clock, and the rule for which database errors are transient.

Also the small helpers every query module shares: rows to frames, UTC normalisation, chunking.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import polars as pl
import psycopg
import sqlalchemy as sa
from sqlalchemy import exc as sa_exc
from sqlalchemy.engine import Engine
from sqlalchemy.ext.compiler import compiles
from sqlalchemy.sql.compiler import SQLCompiler
from sqlalchemy.sql.visitors import InternalTraversal

# ------------------------------------------------------------------ engines and the clock
SUPPORTED_BACKENDS = ("postgresql", "sqlite")


def store_url(url: str) -> sa.engine.URL:
    """`url` parsed, or ValueError for text that is no URL (a port that is no number too) or a
    backend the store has no writes for; the message never holds the URL's password."""
    try:
        parsed = sa.engine.make_url(url)
    except sa_exc.ArgumentError:
        # Not echoed: a URL that does not parse may still hold a password.
        raise ValueError("not a database URL (e.g. postgresql://user@host:5432/db or sqlite:///path)") from None
    except ValueError as error:  # make_url's own: int() of a port that is no number
        raise ValueError(f"not a database URL: {error}") from None
    if parsed.get_backend_name() not in SUPPORTED_BACKENDS:
        raise ValueError(
            f"the store runs on PostgreSQL (postgresql://) or SQLite (sqlite://), not {parsed.drivername}://"
        )
    return parsed


def make_engine(url: str, **kwargs: Any) -> Engine:
    """An engine with the settings each backend needs for concurrent writers.

    ValueError for text that is no URL, a backend the store has no writes for, or a driver that
    is not installed.
    """
    parsed = store_url(url)
    try:
        return _make_engine(parsed, **kwargs)
    except ModuleNotFoundError as missing:
        raise ValueError(f"{parsed.drivername}:// needs the module {missing.name!r}, not installed") from missing


def _make_engine(url: sa.engine.URL, **kwargs: Any) -> Engine:
    if url.get_backend_name() == "sqlite":
        database = url.database
        if database and database != ":memory:":
            Path(database).parent.mkdir(parents=True, exist_ok=True)
        engine = sa.create_engine(url, connect_args={"timeout": 30}, **kwargs)

        @sa.event.listens_for(engine, "connect")
        def _sqlite_pragmas(dbapi_connection: Any, _record: Any) -> None:
            cursor = dbapi_connection.cursor()
            # WAL lets readers see the previous partition while a merge transaction is open.
            cursor.execute("PRAGMA journal_mode=WAL")
            cursor.execute("PRAGMA busy_timeout=30000")
            cursor.close()

        return engine
    # A stale connection (the server restarted) is replaced before use unless the caller retries itself.
    return sa.create_engine(url, **{"pool_pre_ping": True, **kwargs})


def utc_now() -> datetime:
    return datetime.now(UTC)


# ------------------------------------------------------------------ transient errors
# The database is unreachable, overloaded or timed out: the same work may succeed later. psycopg's
# own classes are listed because the COPY into staging runs on the driver cursor, unwrapped.
# psycopg.OperationalError covers a refused or lost connection, statement timeouts
# (QueryCanceled), deadlocks and serialization failures.
_TRANSIENT_ERRORS: tuple[type[BaseException], ...] = (
    sa_exc.OperationalError,
    sa_exc.InterfaceError,
    sa_exc.DisconnectionError,
    sa_exc.TimeoutError,  # the pool had no connection to give in time
    psycopg.OperationalError,
    psycopg.InterfaceError,
    ConnectionError,
    TimeoutError,
)
# SQLite reports a schema that lacks a table or column (a migration not run) as an
# OperationalError, where PostgreSQL says ProgrammingError: no retry fixes it.
_SQLITE_MISSING_SCHEMA = ("no such table", "no such column", "has no column named")


def is_transient_db_error(error: BaseException) -> bool:
    """True when retrying the same database work later may succeed: a refused, lost or invalidated
    connection, a timeout, a locked or overloaded database. False for everything else: refused
    data, a missing table or column, a bug. The batch path's step retries and the service's
    outbox both ask this one question."""
    if isinstance(error, sa_exc.DBAPIError) and error.connection_invalidated:
        return True
    if not isinstance(error, _TRANSIENT_ERRORS):
        return False
    detail = str(error.orig if isinstance(error, sa_exc.DBAPIError) else error)
    return not any(marker in detail for marker in _SQLITE_MISSING_SCHEMA)


def is_missing_schema(error: BaseException) -> bool:
    """The database lacks a table or column Tandem writes (a migration not run): the store is
    broken, not the row, so whatever was being written must be kept for later, not dropped."""
    detail = str(error.orig if isinstance(error, sa_exc.DBAPIError) else error)
    if isinstance(error, sa_exc.ProgrammingError) and ("does not exist" in detail or "UndefinedTable" in detail):
        return True
    return isinstance(error, sa_exc.OperationalError) and any(marker in detail for marker in _SQLITE_MISSING_SCHEMA)


# ------------------------------------------------------------------ shared helpers
def _frame_from_rows(rows: Sequence[Any], schema: dict[str, pl.DataType]) -> pl.DataFrame:
    frame = _rows_frame(rows, schema)
    if "event_ts" in frame.columns:
        frame = frame.with_columns(_as_utc(pl.col("event_ts")))
    return frame


def _rows_frame(rows: Sequence[Any], schema: dict[str, pl.DataType]) -> pl.DataFrame:
    """Rows as the driver returned them; instants still as the dialect hands them back (see _as_utc)."""
    return pl.DataFrame([tuple(r) for r in rows], schema=schema, orient="row")


def _as_utc(column: pl.Expr) -> pl.Expr:
    # SQLite hands back naive datetimes; every stored instant is UTC.
    return column.dt.replace_time_zone(None).dt.replace_time_zone("UTC")


def _chunks(items: Sequence[Any] | Iterable[Any], size: int) -> Iterator[list[Any]]:
    batch: list[Any] = []
    for item in items:
        batch.append(item)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


def _aware(moment: Any) -> datetime:
    """A stored instant in UTC: SQLite hands back naive values, PostgreSQL its session's time zone."""
    value = moment if isinstance(moment, datetime) else datetime.fromisoformat(str(moment))
    return value.astimezone(UTC) if value.tzinfo else value.replace(tzinfo=UTC)


# ------------------------------------------------------------------ text in byte order
class ByteOrder(sa.sql.expression.ColumnElement[str]):
    """A text column compared and ordered by its bytes, as polars orders strings. Which of two
    records of one entity at the same second came first is decided by the record id, in SQL for
    the history a request reads and in polars for a partition's rows: under a linguistic collation
    (en_US, PostgreSQL's usual default) `a-1` sorts before `B-2` in SQL and after it in polars, and
    the two paths scored the same record with different histories. SQLite compares bytes already."""

    inherit_cache = True
    # SQLAlchemy's cache key of a statement is built from this class attribute, as on its own elements.
    _traverse_internals = [("column", InternalTraversal.dp_clauseelement)]  # noqa: RUF012

    def __init__(self, column: sa.ColumnElement[str]) -> None:
        self.column = column
        self.type = column.type


@compiles(ByteOrder)
def _byte_order(element: ByteOrder, compiler: SQLCompiler, **kw: Any) -> str:
    return compiler.process(element.column, **kw)


@compiles(ByteOrder, "postgresql")
def _byte_order_postgresql(element: ByteOrder, compiler: SQLCompiler, **kw: Any) -> str:
    return f'{compiler.process(element.column, **kw)} COLLATE "C"'
