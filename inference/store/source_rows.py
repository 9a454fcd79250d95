"""The record table (`record_table(ls)`): storing a source day, and every read of source rows
(partitions, training windows, an entity's history for features, a partition streamed in chunks).

Every function takes the spec first; its record table names the columns by role. A spec without
an entity has no history: its history reads return no rows."""

from __future__ import annotations

import functools
from collections.abc import Iterator, Sequence
from datetime import UTC, date, datetime
from typing import Any

import polars as pl
import sqlalchemy as sa
from sqlalchemy.dialects import postgresql
from sqlalchemy.engine import Connection, Engine

from inference.records import EVENT_TS_DTYPE, hash_inputs, run_query
from inference.spec import LoadedSpec
from inference.store.engine import ByteOrder, _as_utc, _chunks, _frame_from_rows, _rows_frame, utc_now
from inference.store.merge import _merge, _overwrite_when_changed
from inference.store.record_table import RecordTable, record_table

# SQLite's default SQLITE_MAX_COMPOUND_SELECT is 500 terms per UNION ALL.
_TARGETS_PER_STATEMENT = 400


# ------------------------------------------------------------------ writes
def upsert_records(ls: LoadedSpec, conn: Connection, checked: pl.DataFrame, partition_date: date) -> int:
    """Store a source day's validated rows (RAW + event_ts + reject_reason [+ the label]).

    A row whose contents changed (a correction) is updated and its `ingested_at` moves, which is
    what the late-data sensor watches; re-sending identical rows changes nothing.
    """
    if checked.is_empty():
        return 0
    rt = record_table(ls)
    now = utc_now()
    label = []
    if rt.label is not None:
        values = checked[rt.label] if rt.label in checked.columns else pl.Series([None] * checked.height)
        label = [pl.Series(rt.label, values, dtype=pl.Int16)]
    previous = []
    if rt.previous_entity is not None:
        previous = [
            pl.lit(None, dtype=pl.String).alias(rt.previous_entity),
            pl.lit(None, dtype=EVENT_TS_DTYPE).alias("previous_event_ts"),
        ]
    frame = checked.select(*rt.raw_columns, "event_ts", "reject_reason", *label, hash_inputs(ls, checked)).with_columns(
        pl.lit(partition_date, dtype=pl.Date).alias("partition_date"),
        pl.lit(now, dtype=EVENT_TS_DTYPE).alias("ingested_at"),
        *previous,
    )
    columns = [c.name for c in rt.table.columns]
    keys = [rt.id]
    changed = _overwrite_when_changed(rt.table, keys, "input_hash")

    def in_its_own_partition(excluded: Any) -> tuple[dict[str, Any], Any]:
        # A record never moves to another day; `stored_elsewhere` then names what was left alone.
        set_, when = changed(excluded)
        if rt.previous_entity is not None and rt.entity is not None:
            # The stored row's own values, before this correction (a column unqualified by `excluded`).
            set_ |= {rt.previous_entity: rt.c[rt.entity], "previous_event_ts": rt.c.event_ts}
        return set_, sa.and_(when, rt.c.partition_date == excluded.partition_date)

    return _merge(conn, rt.table, frame.select(columns), keys, in_its_own_partition)


def _one_of(conn: Connection, column: sa.Column[str], values: Sequence[str]) -> Iterator[sa.ColumnElement[bool]]:
    """`column` in `values`, as the predicates of the statements to run: PostgreSQL takes them as
    one array parameter (an IN list of a thousand bound values cost this process twice the CPU of
    the query's result); SQLite caps bound values per statement, so a thousand at a time."""
    if conn.dialect.name == "postgresql":
        if values:
            yield column == sa.any_(
                sa.bindparam(f"{column.name}_values", list(values), type_=postgresql.ARRAY(sa.Text))
            )
        return
    for group in _chunks(list(values), 1000):
        yield column.in_(group)


def stored_elsewhere(
    ls: LoadedSpec, conn: Connection, record_ids: Sequence[str], partition_date: date
) -> dict[str, date]:
    """Which of these ids are stored under another day than `partition_date`, and which."""
    rt = record_table(ls)
    t = rt.c
    found: dict[str, date] = {}
    for wanted in _one_of(conn, t[rt.id], record_ids):
        elsewhere = sa.select(t[rt.id], t.partition_date).where(wanted, t.partition_date != partition_date)
        found.update({record_id: stored_on for record_id, stored_on in conn.execute(elsewhere)})
    return found


# ------------------------------------------------------------------ reads: partitions and training
def _stored_columns(rt: RecordTable, *extra: str) -> list[sa.Column[Any]]:
    return [rt.c[name] for name in rt.rows_schema(*extra)]


def _in_order(rt: RecordTable) -> tuple[sa.ColumnElement[Any], ...]:
    """History order in SQL: entity, event time, id (its bytes)."""
    return tuple(ByteOrder(rt.c[name]) if name == rt.id else rt.c[name] for name in rt.order())


def read_partition_rows(ls: LoadedSpec, conn: Connection, partition_date: date) -> pl.DataFrame:
    """The stored source rows of one day, in a stable order (RAW + event_ts [+ label])."""
    rt = record_table(ls)
    stmt = sa.select(*_stored_columns(rt)).where(rt.c.partition_date == partition_date).order_by(*_in_order(rt))
    return _frame_from_rows(conn.execute(stmt).all(), rt.rows_schema())


def valid_rows_between(ls: LoadedSpec, conn: Connection, start: date, end: date) -> pl.DataFrame:
    """Valid stored rows with partition_date in [start, end), for training."""
    rt = record_table(ls)
    t = rt.c
    stmt = sa.select(*_stored_columns(rt, "partition_date")).where(
        t.partition_date >= start, t.partition_date < end, t.reject_reason.is_(None)
    )
    return _frame_from_rows(conn.execute(stmt).all(), rt.rows_schema("partition_date"))


# ------------------------------------------------------------------ reads: history for features
def fetch_history(ls: LoadedSpec, conn: Connection, targets: pl.DataFrame, history_length: int) -> pl.DataFrame:
    """For each target (entity, event_ts, id): the valid stored rows of its entity that sort before
    it, at most `history_length` each. One indexed LIMIT query per target, so the cost follows the
    request, never the entity's total history. Without an entity there is none."""
    rt = record_table(ls)
    schema = rt.history_schema
    entity = ls.history_entity(history_length)
    if targets.is_empty() or entity is None:
        return pl.DataFrame(schema=schema)
    # Column by column: a `select` would be a polars query of its own, more than this batch's reads.
    rows = list(zip(targets[entity].to_list(), targets["event_ts"].to_list(), targets[rt.id].to_list(), strict=True))
    frames = []
    # SQLite refuses a compound SELECT of more than 500 terms, so large target sets go in groups.
    for group in _chunks(rows, _TARGETS_PER_STATEMENT):
        size = _statement_size(len(group))
        # The last target repeated up to the statement's size reads the same rows again, and
        # `unique` below drops them: the answer is the group's own.
        padded = group + [group[-1]] * (size - len(group))
        result = conn.execute(_history_statement(rt, size), _history_parameters(padded, history_length))
        frames.append(_rows_frame(result.all(), schema).lazy())
    return run_query(
        pl.concat(frames).with_columns(_as_utc(pl.col("event_ts"))).unique(rt.id, keep="first", maintain_order=True)
    )


def warm_history_statements(ls: LoadedSpec, conn: Connection, targets: int) -> None:
    """Compile the history statements of every group of up to `targets` targets now, before the
    first batch needs them: compiling one cost 6-80 ms here, once per process (and engine), and a
    load rising past sizes not seen yet paid them all at once, in p99. None without an entity."""
    rt = record_table(ls)
    if rt.entity is None:
        return
    nowhere = ("", datetime(1970, 1, 1, tzinfo=UTC), "")
    size = 1
    while True:
        conn.execute(_history_statement(rt, size), _history_parameters([nowhere] * size, 1)).all()
        if size >= min(targets, _TARGETS_PER_STATEMENT):
            return
        size = _statement_size(size + 1)


def _statement_size(targets: int) -> int:
    """Targets per history statement: the next power of two, so nine statements serve every group size."""
    return min(1 << (targets - 1).bit_length(), _TARGETS_PER_STATEMENT)


def _history_parameters(targets: Sequence[tuple[object, object, object]], history_length: int) -> dict[str, object]:
    parameters: dict[str, object] = {"history_length": history_length}
    for index, (entity, moment, record_id) in enumerate(targets):
        parameters |= {f"entity_{index}": entity, f"moment_{index}": moment, f"before_{index}": record_id}
    return parameters


def _history_columns(rt: RecordTable) -> list[sa.Column[Any]]:
    return [rt.c[name] for name in rt.history_schema]


@functools.lru_cache(maxsize=32)
def _history_statement(rt: RecordTable, targets: int) -> sa.Executable:
    """The history query for `targets` targets, built once per record table and size with every
    value bound.

    Building the SQLAlchemy expression anew for each batch cost more than the query itself (about
    half of the scoring process's CPU on the online path, measured with py-spy); the same
    statement object also keeps SQLAlchemy's compiled cache warm.
    """
    assert rt.entity is not None
    t = rt.c
    entity, record_id = t[rt.entity], t[rt.id]
    per_target = []
    for index in range(targets):
        moment = sa.bindparam(f"moment_{index}", type_=t.event_ts.type)
        per_target.append(
            sa.select(*_history_columns(rt))
            .where(
                entity == sa.bindparam(f"entity_{index}", type_=entity.type),
                t.reject_reason.is_(None),
                sa.or_(
                    t.event_ts < moment,
                    sa.and_(
                        t.event_ts == moment,
                        ByteOrder(record_id) < sa.bindparam(f"before_{index}", type_=record_id.type),
                    ),
                ),
            )
            .order_by(t.event_ts.desc(), ByteOrder(record_id).desc())
            .limit(sa.bindparam("history_length", type_=sa.Integer()))
            .subquery()
            .select()
        )
    return per_target[0] if targets == 1 else sa.union_all(*per_target)


def prior_history(
    ls: LoadedSpec, conn: Connection, earliest: pl.DataFrame, before: date, history_length: int
) -> pl.DataFrame:
    """The valid rows from days before `before` that some row of a partition's chunk may read as
    history (batch path). `earliest`: per entity, the earliest event_ts of its rows in the chunk.

    Per entity, the `history_length` latest rows of earlier days: every one of them precedes the
    chunk's rows, unless the entity has a late record (D-1's event in D's file, before some of
    D-1's rows). Such an entity, with only those it was scored with none of its real predecessors
    while the online path read them; it reads instead the K rows before its earliest event and
    every row from then on. Only those entities: the bounded read for all of them ran about 5x
    longer per chunk on PostgreSQL (JIT compiled it every time, and the rows from each bound on
    were a hash join over every earlier day). The features' sort then picks each row's own K.
    Without an entity (or at K = 0) nothing is read.
    """
    rt = record_table(ls)
    schema = rt.history_schema
    entity = ls.history_entity(history_length)
    if entity is None:
        return pl.DataFrame(schema=schema)
    bounds = earliest.filter(pl.col(entity).is_not_null() & pl.col("event_ts").is_not_null())
    if bounds.is_empty():
        return pl.DataFrame(schema=schema)
    latest = _latest_rows(rt, conn, bounds[entity].to_list(), before, history_length)
    newest = latest.group_by(entity).agg(pl.col("event_ts").max().alias("newest"))
    # `<=`: at the same instant the order is the ids', so such an entity is read exactly too.
    late = bounds.join(newest, on=entity).filter(pl.col("event_ts") <= pl.col("newest")).drop("newest")
    if late.is_empty():
        return latest
    frames = [latest.filter(~pl.col(entity).is_in(late[entity].implode()))]
    # PostgreSQL takes the bounds as two array parameters; SQLite caps bound values per statement.
    groups = [late] if conn.dialect.name == "postgresql" else [late.slice(i, 500) for i in range(0, late.height, 500)]
    for group in groups:
        stmt = _prior_history_statement(rt, conn.dialect.name, group, before, history_length)
        frames.append(_frame_from_rows(conn.execute(stmt).all(), schema))
    return pl.concat(frames)


def _latest_rows(
    rt: RecordTable, conn: Connection, entities: Sequence[str], before: date, history_length: int
) -> pl.DataFrame:
    """The last `history_length` valid rows per entity from days before `before`."""
    assert rt.entity is not None
    schema = rt.history_schema
    t = rt.c
    frames = []
    for wanted in _one_of(conn, t[rt.entity], entities):
        ranked = (
            sa.select(
                *_history_columns(rt),
                sa.func.row_number()
                .over(partition_by=t[rt.entity], order_by=(t.event_ts.desc(), ByteOrder(t[rt.id]).desc()))
                .label("recency"),
            )
            .where(wanted, t.partition_date < before, t.reject_reason.is_(None))
            .subquery()
        )
        stmt = sa.select(*(ranked.c[name] for name in schema)).where(ranked.c.recency <= history_length)
        frames.append(_frame_from_rows(conn.execute(stmt).all(), schema))
    return pl.concat(frames) if frames else pl.DataFrame(schema=schema)


def _prior_history_statement(
    rt: RecordTable, dialect: str, bounds: pl.DataFrame, before: date, history_length: int
) -> sa.Executable:
    assert rt.entity is not None
    t = rt.c
    entity, record_id = t[rt.entity], t[rt.id]
    entities = bounds[rt.entity].to_list()
    moments = bounds["event_ts"].to_list()
    columns = _history_columns(rt)
    schema = rt.history_schema
    earlier_days = [t.partition_date < before, t.reject_reason.is_(None)]
    if dialect == "postgresql":
        table = (
            sa.func.unnest(
                sa.bindparam("entities", entities, type_=postgresql.ARRAY(sa.Text)),
                sa.bindparam("earliest", moments, type_=postgresql.ARRAY(t.event_ts.type)),
            )
            .table_valued(sa.column("entity", sa.Text), sa.column("earliest", t.event_ts.type))
            .render_derived("bounds")
        )
        # Per entity, the K rows before the bound read through its index (a LATERAL ... LIMIT),
        # then the rows from the bound on. One window over the bounds joined with every earlier
        # row of the entities was planned as a hash join over all earlier days.
        own = [entity == table.c.entity, *earlier_days]
        before_bound = (
            sa.select(*columns)
            .where(*own, t.event_ts < table.c.earliest)
            .order_by(t.event_ts.desc(), ByteOrder(record_id).desc())
            .limit(history_length)
            .lateral("before_bound")
        )
        from_bound = sa.select(*columns).where(*own, t.event_ts >= table.c.earliest).lateral("from_bound")
        return sa.union_all(
            *(
                sa.select(*(part.c[name] for name in schema)).select_from(table).join(part, sa.true())
                for part in (before_bound, from_bound)
            )
        )
    # A CTE: SQLite takes no column names on a VALUES in FROM.
    values = (
        sa.values(sa.column("entity", sa.Text), sa.column("earliest", t.event_ts.type), name="bounds")
        .data(list(zip(entities, moments, strict=True)))
        .cte("bounds")
    )
    ranked = (
        sa.select(
            *columns,
            sa.func.row_number()
            .over(partition_by=entity, order_by=(t.event_ts.desc(), ByteOrder(record_id).desc()))
            .label("recency"),
            # The rows at or after the bound come first in `recency`; K more are the history before it.
            sa.func.sum(sa.case((t.event_ts >= values.c.earliest, 1), else_=0))
            .over(partition_by=entity)
            .label("later"),
        )
        .join_from(rt.table, values, entity == values.c.entity)
        .where(entity.in_(entities), *earlier_days)
        .subquery()
    )
    return sa.select(*(ranked.c[name] for name in schema)).where(ranked.c.recency <= ranked.c.later + history_length)


class StoreHistory:
    """History read from the record table, for callers that hold single records."""

    def __init__(self, ls: LoadedSpec, engine: Engine) -> None:
        self.spec = ls
        self.engine = engine

    def history_for(self, targets: pl.DataFrame, history_length: int) -> pl.DataFrame:
        with self.engine.connect() as conn:
            return fetch_history(self.spec, conn, targets, history_length)


# ------------------------------------------------------------------ reads: a partition streamed, the stored days
def stream_partition_rows(
    ls: LoadedSpec, engine: Engine, partition_date: date, chunk_rows: int
) -> Iterator[pl.DataFrame]:
    """A day's stored rows in chunks (RAW + event_ts [+ label] + input_hash), ordered by entity so
    each entity's rows are contiguous.

    PostgreSQL: one `COPY ... TO STDOUT` whose CSV polars parses, chunk by chunk, off a stream that
    the socket paces, so memory is flat in the partition size; building the chunks from Python
    row tuples cost 2.5x the CPU (bench/findings.md). SQLite's cursor is lazy already.
    """
    rt = record_table(ls)
    schema = rt.rows_schema("input_hash")
    if engine.dialect.name == "postgresql":
        yield from _copy_partition_rows(rt, engine, partition_date, chunk_rows, schema)
        return
    stmt = (
        sa.select(*_stored_columns(rt, "input_hash"))
        .where(rt.c.partition_date == partition_date)
        .order_by(*_in_order(rt))
    )
    with engine.connect() as conn:
        result = conn.execution_options(stream_results=True, yield_per=chunk_rows).execute(stmt)
        for rows in result.partitions(chunk_rows):
            yield _frame_from_rows(rows, schema)


def _copy_partition_rows(
    rt: RecordTable, engine: Engine, partition_date: date, chunk_rows: int, schema: dict[str, pl.DataType]
) -> Iterator[pl.DataFrame]:
    t = rt.c
    text_columns = [name for name, dtype in schema.items() if dtype == pl.String()]
    # The instant as integer microseconds since the epoch: exact, and free of the session's time
    # zone and DateStyle, which would otherwise decide how the CSV spells a timestamp.
    event_us = sa.cast(sa.extract("epoch", t.event_ts) * 1_000_000, sa.BigInteger).label("event_ts")
    select = (
        sa.select(*(event_us if name == "event_ts" else t[name] for name in schema))
        .where(t.partition_date == partition_date)
        .order_by(*_in_order(rt))
    )
    # SQLAlchemy writes the query and its bound parameters; psycopg binds them into the COPY.
    query = select.compile(dialect=engine.dialect)
    # Every text value quoted, so a NULL (unquoted, empty) cannot be read back as the empty string.
    copy_sql = f"COPY ({query}) TO STDOUT WITH (FORMAT csv, FORCE_QUOTE ({', '.join(text_columns)}))"
    read_schema = {**schema, "event_ts": pl.Int64()}

    def parsed(lines: list[bytes]) -> pl.DataFrame:
        frame = pl.read_csv(
            b"".join(lines),
            has_header=False,
            new_columns=list(read_schema),
            schema=read_schema,
            # An unquoted empty field is null; a quoted one ("") stays the empty string.
            empty_string_is_null=True,
        )
        return frame.with_columns(pl.col("event_ts").cast(EVENT_TS_DTYPE))

    with engine.connect() as conn:
        cursor = conn.connection.driver_connection.cursor()  # type: ignore[union-attr]
        try:
            with cursor.copy(copy_sql, query.params) as copy:
                lines: list[bytes] = []
                # PostgreSQL sends COPY TO's output one row per message.
                for line in copy:
                    lines.append(bytes(line))
                    if len(lines) == chunk_rows:
                        yield parsed(lines)
                        lines = []
                if lines:
                    yield parsed(lines)
        finally:
            cursor.close()


def stored_partition_dates(ls: LoadedSpec, conn: Connection) -> list[date]:
    t = record_table(ls).c
    stmt = sa.select(t.partition_date).distinct().order_by(t.partition_date)
    return [row[0] if isinstance(row[0], date) else date.fromisoformat(str(row[0])) for row in conn.execute(stmt)]
