"""A SQL query over the partition's time window, as a source of a day's records."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, date, datetime, timedelta
from typing import Any

import polars as pl
import sqlalchemy as sa

from inference.records import format_event_time, raw_frame, received_columns
from inference.sources.common import SourceError, SourceRead, _missing, _one_line, label_column
from inference.spec import LoadedSpec

# ---------------------------------------------------------------------------------------------
# SQL: a query over the partition's time window.


def day_window(day: date) -> tuple[datetime, datetime]:
    """[start, end) of one UTC day."""
    start = datetime(day.year, day.month, day.day, tzinfo=UTC)
    return start, start + timedelta(days=1)


@dataclass(frozen=True)
class SqlSource:
    """Rows of `query` against `url` (any SQLAlchemy URL). The query gets `:start` and `:end`
    (UTC datetimes, [start, end)) and `:day` (the date); it must return the spec's field names
    (and its label, when it has one)."""

    spec: LoadedSpec
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
                _times_out_of_range_as_text(conn.connection.driver_connection)
                try:
                    result = conn.execute(sa.text(self.query), {"start": start, "end": end, "day": day})
                    columns = list(result.keys())
                except sa.exc.StatementError as error:
                    if isinstance(error, sa.exc.DBAPIError) and error.connection_invalidated:
                        raise  # the connection dropped mid-query
                    # On a live connection a failing query is the query's fault (a typo, no such
                    # table): retrying runs the same text again.
                    raise SourceError(f"{self.where}: the query failed: {_one_line(error.orig or error)}") from error
                try:
                    rows = result.all()
                except sa.exc.StatementError as error:
                    if isinstance(error, sa.exc.DBAPIError) and error.connection_invalidated:
                        raise
                    # The query ran; a value in its rows could not be read (not the query's fault).
                    raise SourceError(
                        f"{self.where}: a row could not be read: {_one_line(error.orig or error)}"
                    ) from error
        finally:
            engine.dispose()
        return SourceRead(self._frame(columns, rows), self.kind, (self.where,), None)

    def _frame(self, columns: list[str], rows: Sequence[Any]) -> pl.DataFrame:
        ls = self.spec
        _missing(ls, columns, self.where)
        records = [dict(zip(columns, row, strict=True)) for row in rows]
        event_time, label = ls.event_time.name, label_column(ls)
        for record in records:
            moment = record[event_time]
            if isinstance(moment, datetime):
                if moment.tzinfo is None:
                    raise SourceError(
                        f"{self.where}: column {event_time!r}: timestamp without a time zone; "
                        "return timestamptz or ISO-8601 text with an offset"
                    )
                record[event_time] = format_event_time(moment)
        frame = raw_frame(ls, records).with_columns(received_columns(ls, records))
        if label is not None and label in columns:
            labels = [_label_value(record[label]) for record in records]
            frame = frame.with_columns(pl.Series(label, labels, dtype=pl.Int16))
        return frame

    def records_for(self, day: date) -> pl.DataFrame:
        return self.read(day).frame


def _times_out_of_range_as_text(driver_connection: Any) -> None:
    """PostgreSQL's timestamptz 'infinity' (a common sentinel) or a year after 9999 has no Python
    datetime: psycopg failed the whole read on it, and psycopg2 turned 'infinity' into 9999-12-31
    and '-infinity' into the year 1, which would be scored. Read as its text, such a value is one
    row for validation to quarantine (timestamp_unparsable)."""
    module = type(driver_connection).__module__
    if module.startswith("psycopg2"):
        from psycopg2 import extensions

        def cast(value: str | None, cursor: Any) -> Any:
            if value is None or value.lstrip("-") == "infinity":
                return value
            try:
                return extensions.PYDATETIMETZ(value, cursor)
            except ValueError:
                return value

        extensions.register_type(extensions.new_type((1184,), "TIMESTAMPTZ_OR_TEXT", cast), driver_connection)
    elif module.startswith("psycopg"):
        import psycopg
        from psycopg.types.datetime import TimestamptzLoader

        class _TimestamptzOrText(TimestamptzLoader):
            def load(self, data: Any) -> Any:
                try:
                    return super().load(data)
                except psycopg.DataError:
                    return bytes(data).decode()

        driver_connection.adapters.register_loader("timestamptz", _TimestamptzOrText)


def _label_value(value: Any) -> int | None:
    """0 or 1 (a bool, an int, a Decimal, a float, "1.0"), else None: not known, as `conform` reads it."""
    try:
        number = float(value.strip() if isinstance(value, str) else value)
    except (TypeError, ValueError):
        return None
    return int(number) if number in (0.0, 1.0) else None
