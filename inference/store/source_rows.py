"""`transactions`: storing a source day, and every read of source rows (partitions, training
windows, account history for features, a partition streamed in chunks)."""

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
from inference.store.engine import ByteOrder, _as_utc, _chunks, _frame_from_rows, _rows_frame, utc_now
from inference.store.merge import _merge, _overwrite_when_changed
from inference.store.schema import HISTORY_SCHEMA, RAW_COLUMNS, RAW_SCHEMA, REFERENCE_SPEC, transactions

# SQLite's default SQLITE_MAX_COMPOUND_SELECT is 500 terms per UNION ALL.
_TARGETS_PER_STATEMENT = 400


# ------------------------------------------------------------------ writes
def upsert_transactions(conn: Connection, checked: pl.DataFrame, partition_date: date) -> int:
    """Store a source day's validated rows (RAW + event_ts + reject_reason [+ label_fraud]).

    A row whose contents changed (a correction) is updated and its `ingested_at` moves, which is
    what the late-data sensor watches; re-sending identical rows changes nothing.
    """
    if checked.is_empty():
        return 0
    now = utc_now()
    labels = checked["label_fraud"] if "label_fraud" in checked.columns else pl.Series([None] * checked.height)
    frame = checked.select(
        *RAW_COLUMNS,
        "event_ts",
        "reject_reason",
        pl.Series("label_fraud", labels, dtype=pl.Int16),
        hash_inputs(REFERENCE_SPEC, checked),
    ).with_columns(
        partition_date=pl.lit(partition_date, dtype=pl.Date),
        ingested_at=pl.lit(now, dtype=EVENT_TS_DTYPE),
        previous_account_id=pl.lit(None, dtype=pl.String),
        previous_event_ts=pl.lit(None, dtype=EVENT_TS_DTYPE),
    )
    columns = [c.name for c in transactions.columns]
    keys = ["transaction_id"]
    changed = _overwrite_when_changed(transactions, keys, "input_hash")

    def in_its_own_partition(excluded: Any) -> tuple[dict[str, Any], Any]:
        # A record never moves to another day; `stored_elsewhere` then names what was left alone.
        set_, when = changed(excluded)
        # The stored row's own values, before this correction (a column unqualified by `excluded`).
        set_ |= {"previous_account_id": transactions.c.account_id, "previous_event_ts": transactions.c.event_ts}
        return set_, sa.and_(when, transactions.c.partition_date == excluded.partition_date)

    return _merge(conn, transactions, frame.select(columns), keys, in_its_own_partition)


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


def stored_elsewhere(conn: Connection, transaction_ids: Sequence[str], partition_date: date) -> dict[str, date]:
    """Which of these ids are stored under another day than `partition_date`, and which."""
    t = transactions.c
    found: dict[str, date] = {}
    for wanted in _one_of(conn, transactions.c.transaction_id, transaction_ids):
        elsewhere = sa.select(t.transaction_id, t.partition_date).where(wanted, t.partition_date != partition_date)
        found.update({transaction_id: stored_on for transaction_id, stored_on in conn.execute(elsewhere)})
    return found


# ------------------------------------------------------------------ reads: partitions and training
def read_partition_rows(conn: Connection, partition_date: date) -> pl.DataFrame:
    """The stored source rows of one day, in a stable order (RAW + event_ts + label + hash)."""
    stmt = (
        sa.select(
            *(transactions.c[name] for name in RAW_COLUMNS),
            transactions.c.event_ts,
            transactions.c.label_fraud,
        )
        .where(transactions.c.partition_date == partition_date)
        .order_by(transactions.c.account_id, transactions.c.event_ts, ByteOrder(transactions.c.transaction_id))
    )
    schema = {**RAW_SCHEMA, "event_ts": EVENT_TS_DTYPE, "label_fraud": pl.Int16()}
    return _frame_from_rows(conn.execute(stmt).all(), schema)


def valid_rows_between(conn: Connection, start: date, end: date) -> pl.DataFrame:
    """Valid stored rows with partition_date in [start, end), for training."""
    stmt = sa.select(
        *(transactions.c[name] for name in RAW_COLUMNS),
        transactions.c.event_ts,
        transactions.c.label_fraud,
        transactions.c.partition_date,
    ).where(
        transactions.c.partition_date >= start,
        transactions.c.partition_date < end,
        transactions.c.reject_reason.is_(None),
    )
    schema = {**RAW_SCHEMA, "event_ts": EVENT_TS_DTYPE, "label_fraud": pl.Int16(), "partition_date": pl.Date()}
    return _frame_from_rows(conn.execute(stmt).all(), schema)


# ------------------------------------------------------------------ reads: history for features
def fetch_history(conn: Connection, targets: pl.DataFrame, history_length: int) -> pl.DataFrame:
    """For each target (account_id, event_ts, transaction_id): the valid stored rows of its account
    that sort before it, at most `history_length` each. One indexed LIMIT query per target, so
    the cost follows the request, never the account's total history."""
    schema = HISTORY_SCHEMA
    if targets.is_empty():
        return pl.DataFrame(schema=schema)
    # Column by column: a `select` would be a polars query of its own, more than this batch's reads.
    rows = list(
        zip(
            targets["account_id"].to_list(),
            targets["event_ts"].to_list(),
            targets["transaction_id"].to_list(),
            strict=True,
        )
    )
    frames = []
    # SQLite refuses a compound SELECT of more than 500 terms, so large target sets go in groups.
    for group in _chunks(rows, _TARGETS_PER_STATEMENT):
        size = _statement_size(len(group))
        # The last target repeated up to the statement's size reads the same rows again, and
        # `unique` below drops them: the answer is the group's own.
        padded = group + [group[-1]] * (size - len(group))
        result = conn.execute(_history_statement(size), _history_parameters(padded, history_length))
        frames.append(_rows_frame(result.all(), schema).lazy())
    return run_query(
        pl.concat(frames)
        .with_columns(_as_utc(pl.col("event_ts")))
        .unique("transaction_id", keep="first", maintain_order=True)
    )


def warm_history_statements(conn: Connection, targets: int) -> None:
    """Compile the history statements of every group of up to `targets` targets now, before the
    first batch needs them: compiling one cost 6-80 ms here, once per process (and engine), and a
    load rising past sizes not seen yet paid them all at once, in p99."""
    nowhere = ("", datetime(1970, 1, 1, tzinfo=UTC), "")
    size = 1
    while True:
        conn.execute(_history_statement(size), _history_parameters([nowhere] * size, 1)).all()
        if size >= min(targets, _TARGETS_PER_STATEMENT):
            return
        size = _statement_size(size + 1)


def _statement_size(targets: int) -> int:
    """Targets per history statement: the next power of two, so nine statements serve every group size."""
    return min(1 << (targets - 1).bit_length(), _TARGETS_PER_STATEMENT)


def _history_parameters(targets: Sequence[tuple[object, object, object]], history_length: int) -> dict[str, object]:
    parameters: dict[str, object] = {"history_length": history_length}
    for index, (account_id, moment, transaction_id) in enumerate(targets):
        parameters |= {f"account_{index}": account_id, f"moment_{index}": moment, f"before_{index}": transaction_id}
    return parameters


@functools.lru_cache(maxsize=16)
def _history_statement(targets: int) -> sa.Executable:
    """The history query for `targets` targets, built once per size with every value bound.

    Building the SQLAlchemy expression anew for each batch cost more than the query itself (about
    half of the scoring process's CPU on the online path, measured with py-spy); the same
    statement object also keeps SQLAlchemy's compiled cache warm.
    """
    t = transactions.c
    columns = [*(t[name] for name in RAW_COLUMNS), t.event_ts, t.input_hash]
    per_target = []
    for index in range(targets):
        moment = sa.bindparam(f"moment_{index}", type_=t.event_ts.type)
        per_target.append(
            sa.select(*columns)
            .where(
                t.account_id == sa.bindparam(f"account_{index}", type_=t.account_id.type),
                t.reject_reason.is_(None),
                sa.or_(
                    t.event_ts < moment,
                    sa.and_(
                        t.event_ts == moment,
                        ByteOrder(t.transaction_id) < sa.bindparam(f"before_{index}", type_=t.transaction_id.type),
                    ),
                ),
            )
            .order_by(t.event_ts.desc(), ByteOrder(t.transaction_id).desc())
            .limit(sa.bindparam("history_length", type_=sa.Integer()))
            .subquery()
            .select()
        )
    return per_target[0] if targets == 1 else sa.union_all(*per_target)


def prior_history(conn: Connection, earliest: pl.DataFrame, before: date, history_length: int) -> pl.DataFrame:
    """The valid rows from days before `before` that some row of a partition's chunk may read as
    history (batch path). `earliest`: per account_id, the earliest event_ts of its rows in the chunk.

    Per account, the `history_length` latest rows of earlier days: every one of them precedes the
    chunk's rows, unless the account has a late record (D-1's event in D's file, before some of
    D-1's rows). Such an account, with only those it was scored with none of its real predecessors
    while the online path read them; it reads instead the K rows before its earliest event and
    every row from then on. Only those accounts: the bounded read for all of them ran about 5x
    longer per chunk on PostgreSQL (JIT compiled it every time, and the rows from each bound on
    were a hash join over every earlier day). The features' sort then picks each row's own K.
    """
    schema = HISTORY_SCHEMA
    bounds = earliest.filter(pl.col("account_id").is_not_null() & pl.col("event_ts").is_not_null())
    if bounds.is_empty():
        return pl.DataFrame(schema=schema)
    latest = _latest_rows(conn, bounds["account_id"].to_list(), before, history_length)
    newest = latest.group_by("account_id").agg(pl.col("event_ts").max().alias("newest"))
    # `<=`: at the same instant the order is the ids', so such an account is read exactly too.
    late = bounds.join(newest, on="account_id").filter(pl.col("event_ts") <= pl.col("newest")).drop("newest")
    if late.is_empty():
        return latest
    frames = [latest.filter(~pl.col("account_id").is_in(late["account_id"].implode()))]
    # PostgreSQL takes the bounds as two array parameters; SQLite caps bound values per statement.
    groups = [late] if conn.dialect.name == "postgresql" else [late.slice(i, 500) for i in range(0, late.height, 500)]
    for group in groups:
        stmt = _prior_history_statement(conn.dialect.name, group, before, history_length)
        frames.append(_frame_from_rows(conn.execute(stmt).all(), schema))
    return pl.concat(frames)


def _latest_rows(conn: Connection, account_ids: Sequence[str], before: date, history_length: int) -> pl.DataFrame:
    """The last `history_length` valid rows per account from days before `before`."""
    schema = HISTORY_SCHEMA
    t = transactions.c
    frames = []
    for wanted in _one_of(conn, transactions.c.account_id, account_ids):
        ranked = (
            sa.select(
                *(t[name] for name in RAW_COLUMNS),
                t.event_ts,
                t.input_hash,
                sa.func.row_number()
                .over(partition_by=t.account_id, order_by=(t.event_ts.desc(), ByteOrder(t.transaction_id).desc()))
                .label("recency"),
            )
            .where(wanted, t.partition_date < before, t.reject_reason.is_(None))
            .subquery()
        )
        stmt = sa.select(*(ranked.c[name] for name in HISTORY_SCHEMA)).where(ranked.c.recency <= history_length)
        frames.append(_frame_from_rows(conn.execute(stmt).all(), schema))
    return pl.concat(frames) if frames else pl.DataFrame(schema=schema)


def _prior_history_statement(dialect: str, bounds: pl.DataFrame, before: date, history_length: int) -> sa.Executable:
    t = transactions.c
    accounts = bounds["account_id"].to_list()
    moments = bounds["event_ts"].to_list()
    columns = [*(t[name] for name in RAW_COLUMNS), t.event_ts, t.input_hash]
    earlier_days = [t.partition_date < before, t.reject_reason.is_(None)]
    if dialect == "postgresql":
        table = (
            sa.func.unnest(
                sa.bindparam("accounts", accounts, type_=postgresql.ARRAY(sa.Text)),
                sa.bindparam("earliest", moments, type_=postgresql.ARRAY(t.event_ts.type)),
            )
            .table_valued(sa.column("account_id", sa.Text), sa.column("earliest", t.event_ts.type))
            .render_derived("bounds")
        )
        # Per account, the K rows before the bound read through its index (a LATERAL ... LIMIT),
        # then the rows from the bound on. One window over the bounds joined with every earlier
        # row of the accounts was planned as a hash join over all earlier days.
        own = [t.account_id == table.c.account_id, *earlier_days]
        before_bound = (
            sa.select(*columns)
            .where(*own, t.event_ts < table.c.earliest)
            .order_by(t.event_ts.desc(), ByteOrder(t.transaction_id).desc())
            .limit(history_length)
            .lateral("before_bound")
        )
        from_bound = sa.select(*columns).where(*own, t.event_ts >= table.c.earliest).lateral("from_bound")
        return sa.union_all(
            *(
                sa.select(*(part.c[name] for name in HISTORY_SCHEMA)).select_from(table).join(part, sa.true())
                for part in (before_bound, from_bound)
            )
        )
    # A CTE: SQLite takes no column names on a VALUES in FROM.
    values = (
        sa.values(sa.column("account_id", sa.Text), sa.column("earliest", t.event_ts.type), name="bounds")
        .data(list(zip(accounts, moments, strict=True)))
        .cte("bounds")
    )
    ranked = (
        sa.select(
            *columns,
            sa.func.row_number()
            .over(partition_by=t.account_id, order_by=(t.event_ts.desc(), ByteOrder(t.transaction_id).desc()))
            .label("recency"),
            # The rows at or after the bound come first in `recency`; K more are the history before it.
            sa.func.sum(sa.case((t.event_ts >= values.c.earliest, 1), else_=0))
            .over(partition_by=t.account_id)
            .label("later"),
        )
        .join_from(transactions, values, t.account_id == values.c.account_id)
        .where(t.account_id.in_(accounts), *earlier_days)
        .subquery()
    )
    return sa.select(*(ranked.c[name] for name in HISTORY_SCHEMA)).where(
        ranked.c.recency <= ranked.c.later + history_length
    )


class StoreHistory:
    """History read from the `transactions` table, for callers that hold single records."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def history_for(self, targets: pl.DataFrame, history_length: int) -> pl.DataFrame:
        with self.engine.connect() as conn:
            return fetch_history(conn, targets, history_length)


# ------------------------------------------------------------------ reads: a partition streamed, the stored days
def stream_partition_rows(engine: Engine, partition_date: date, chunk_rows: int) -> Iterator[pl.DataFrame]:
    """A day's stored rows in chunks, ordered by account so each account's rows are contiguous.

    PostgreSQL: one `COPY ... TO STDOUT` whose CSV polars parses, chunk by chunk, off a stream that
    the socket paces, so memory is flat in the partition size; building the chunks from Python
    row tuples cost 2.5x the CPU (bench/findings.md). SQLite's cursor is lazy already.
    """
    t = transactions.c
    schema = {**RAW_SCHEMA, "event_ts": EVENT_TS_DTYPE, "label_fraud": pl.Int16(), "input_hash": pl.String()}
    order = (t.account_id, t.event_ts, ByteOrder(t.transaction_id))
    if engine.dialect.name == "postgresql":
        yield from _copy_partition_rows(engine, partition_date, chunk_rows, schema, order)
        return
    stmt = (
        sa.select(*(t[name] for name in RAW_COLUMNS), t.event_ts, t.label_fraud, t.input_hash)
        .where(t.partition_date == partition_date)
        .order_by(*order)
    )
    with engine.connect() as conn:
        result = conn.execution_options(stream_results=True, yield_per=chunk_rows).execute(stmt)
        for rows in result.partitions(chunk_rows):
            yield _frame_from_rows(rows, schema)


def _copy_partition_rows(
    engine: Engine,
    partition_date: date,
    chunk_rows: int,
    schema: dict[str, pl.DataType],
    order: tuple[sa.ColumnElement[Any], ...],
) -> Iterator[pl.DataFrame]:
    t = transactions.c
    text_columns = [name for name, dtype in schema.items() if dtype == pl.String()]
    # The instant as integer microseconds since the epoch: exact, and free of the session's time
    # zone and DateStyle, which would otherwise decide how the CSV spells a timestamp.
    event_us = sa.cast(sa.extract("epoch", t.event_ts) * 1_000_000, sa.BigInteger).label("event_ts")
    select = (
        sa.select(*(event_us if name == "event_ts" else t[name] for name in schema))
        .where(t.partition_date == partition_date)
        .order_by(*order)
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


def stored_partition_dates(conn: Connection) -> list[date]:
    stmt = sa.select(transactions.c.partition_date).distinct().order_by(transactions.c.partition_date)
    return [row[0] if isinstance(row[0], date) else date.fromisoformat(str(row[0])) for row in conn.execute(stmt)]
