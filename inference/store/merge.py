"""The upsert machinery every write goes through: staging COPY and merge on PostgreSQL, batched
INSERT ... ON CONFLICT on SQLite, with a conflict policy saying what an existing key gets.

Idempotent by construction: a replayed write meets its own keys and changes nothing (or only
what the policy allows), so retries and reruns never duplicate.
"""

from __future__ import annotations

import functools
import io
from typing import Any

import polars as pl
import sqlalchemy as sa
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import Connection

from inference.store.engine import _chunks

# SQLite's default host-parameter limit is 32766; stay well below it per statement.
_SQLITE_ROWS_PER_STATEMENT = 500
# Up to this many rows, a PostgreSQL upsert sends its rows to one INSERT ... ON CONFLICT (psycopg
# pipelines them): a staging table's five statements cost more for the online writer's few rows.
POSTGRES_ROWS_WITHOUT_STAGING = 32


def _insert_for(conn: Connection, table: sa.Table) -> Any:
    return postgresql.insert(table) if conn.dialect.name == "postgresql" else sqlite.insert(table)


ConflictPolicy = Any  # (excluded columns) -> (SET assignments, WHERE clause)


def _merge(
    conn: Connection,
    table: sa.Table,
    frame: pl.DataFrame,
    keys: list[str],
    on_conflict: ConflictPolicy,
) -> int:
    """Upsert `frame` into `table`; `on_conflict` says what an existing key gets, and when.

    PostgreSQL, past POSTGRES_ROWS_WITHOUT_STAGING rows: COPY into a temporary staging table, then
    one INSERT ... SELECT ... ON CONFLICT. Otherwise, and on SQLite: INSERT ... ON CONFLICT DO
    UPDATE with the rows as parameters. Rows go in key order either way (a fixed lock order, so
    concurrent merges cannot deadlock), and the caller's transaction decides atomicity.
    """
    postgres = conn.dialect.name == "postgresql"
    if postgres and frame.height > POSTGRES_ROWS_WITHOUT_STAGING:
        staging = _copy_to_staging(conn, table, frame)
        source = sa.select(*(staging.c[name] for name in frame.columns)).order_by(*(staging.c[k] for k in keys))
        merge = postgresql.insert(table).from_select(list(frame.columns), source)
        set_, where = on_conflict(merge.excluded)
        statement = merge.on_conflict_do_update(index_elements=keys, set_=set_, where=where)
        return int(conn.execute(statement, execution_options={"preserve_rowcount": True}).rowcount)
    upsert = _upsert_statement(conn.dialect.name, table, tuple(keys), on_conflict)
    rows = _python_rows(frame.sort(keys) if postgres else frame)
    changed = 0
    for chunk in _chunks(rows, _SQLITE_ROWS_PER_STATEMENT):
        changed += conn.execute(upsert, chunk, execution_options={"preserve_rowcount": True}).rowcount
    return changed


@functools.lru_cache(maxsize=16)
def _upsert_statement(dialect: str, table: sa.Table, keys: tuple[str, ...], on_conflict: ConflictPolicy) -> Any:
    """INSERT ... ON CONFLICT DO UPDATE for `table`, built once per policy: building it (the
    `excluded` columns) cost more than the write of one online answer. A policy made per call
    (a closure) only misses."""
    insert = postgresql.insert(table) if dialect == "postgresql" else sqlite.insert(table)
    set_, where = on_conflict(insert.excluded)
    return insert.on_conflict_do_update(index_elements=list(keys), set_=set_, where=where)


def _overwrite_when_changed(table: sa.Table, keys: list[str], change_column: str) -> ConflictPolicy:
    def policy(excluded: Any) -> tuple[dict[str, Any], Any]:
        set_ = {c.name: excluded[c.name] for c in table.columns if c.name not in keys}
        return set_, table.c[change_column] != excluded[change_column]

    return policy


def _copy_to_staging(conn: Connection, table: sa.Table, frame: pl.DataFrame) -> sa.TableClause:
    """COPY `frame` into a per-transaction temporary twin of `table` (emptied at commit)."""
    # Identifiers come from our own table metadata, never from input; values go through COPY.
    staging = f"staging_{table.name}"
    preparer = conn.dialect.identifier_preparer
    quoted = ", ".join(preparer.quote(c) for c in frame.columns)
    conn.exec_driver_sql(
        f"CREATE TEMPORARY TABLE IF NOT EXISTS {staging} "
        f"(LIKE {preparer.quote(table.name)} INCLUDING DEFAULTS) ON COMMIT DELETE ROWS"
    )
    conn.exec_driver_sql(f"TRUNCATE {staging}")
    buffer = io.BytesIO()
    # Every non-null text quoted: a value that spells the NULL marker (the text \N) must arrive as
    # text, and polars leaves it unquoted otherwise.
    frame.write_csv(
        buffer,
        include_header=False,
        null_value="\\N",
        quote_style="non_numeric",
        datetime_format="%Y-%m-%dT%H:%M:%S.%6f%z",
    )
    driver_cursor = conn.connection.driver_connection.cursor()  # type: ignore[union-attr]
    try:
        with driver_cursor.copy(f"COPY {staging} ({quoted}) FROM STDIN WITH (FORMAT csv, NULL '\\N')") as copy:
            copy.write(buffer.getvalue())
    finally:
        driver_cursor.close()
    return sa.table(staging, *(sa.column(name, table.c[name].type) for name in frame.columns))


def _python_rows(frame: pl.DataFrame) -> list[dict[str, Any]]:
    return frame.to_dicts()
