"""SQLAlchemy Core tables and every write the platform makes; the only module that speaks SQL.

All statements are built with SQLAlchemy (parameterised). Writes are idempotent upserts keyed by
the data contract's keys, never blind appends, so a retried or replayed write changes nothing.
"""

from __future__ import annotations

import enum
import hashlib
import io
import json
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from datetime import UTC, date, datetime
from pathlib import Path
from typing import Any

import polars as pl
import sqlalchemy as sa
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import Connection, Engine

from inference.records import EVENT_TS_DTYPE, RAW_COLUMNS, RAW_SCHEMA, hash_inputs

metadata = sa.MetaData()


class ResultPath(enum.StrEnum):
    BATCH = "batch"
    ONLINE = "online"


class Resolution(enum.StrEnum):
    OPERATOR = "operator"  # someone fixed the source; the partition should be re-ingested and rescored
    SUPERSEDED = "superseded"  # the record changed and was rescored; nothing left to do


class RejectStage(enum.StrEnum):
    INGEST = "ingest"  # could not even be stored as a source record (no id, repeated id)
    SCORE = "score"  # stored, then refused by validation or the model
    WRITE = "write"  # scored, but the result store refused the result row itself (a data error)


# The reason of a WRITE-stage rejection; validation reasons are `records.RejectReason`.
UNWRITABLE_RESULT = "unwritable_result"


transactions = sa.Table(
    "transactions",
    metadata,
    sa.Column("transaction_id", sa.Text, primary_key=True),
    sa.Column("account_id", sa.Text, nullable=True),
    sa.Column("amount", sa.Float(precision=53), nullable=True),
    sa.Column("currency", sa.Text, nullable=True),
    sa.Column("merchant_category", sa.Text, nullable=True),
    sa.Column("country", sa.Text, nullable=True),
    sa.Column("event_time", sa.Text, nullable=True, comment="as received from the source"),
    sa.Column("event_ts", sa.DateTime(timezone=True), nullable=True, comment="event_time parsed, UTC"),
    sa.Column("partition_date", sa.Date, nullable=False, comment="the source day; the Dagster partition"),
    sa.Column("reject_reason", sa.Text, nullable=True, comment="validation result at ingest; null = valid"),
    sa.Column("label_fraud", sa.SmallInteger, nullable=True, comment="ground truth where known (demo data)"),
    sa.Column("input_hash", sa.Text, nullable=False),
    sa.Column("ingested_at", sa.DateTime(timezone=True), nullable=False),
    sa.Index("ix_transactions_partition_date", "partition_date"),
    sa.Index("ix_transactions_account_event", "account_id", "event_ts", "transaction_id"),
    sa.Index("ix_transactions_ingested_at", "ingested_at"),
)

predictions = sa.Table(
    "predictions",
    metadata,
    sa.Column("transaction_id", sa.Text, primary_key=True),
    sa.Column("model_version", sa.Text, primary_key=True),
    sa.Column("path", sa.Text, primary_key=True),
    # Both paths' answers are kept side by side (docs/decisions/0002): a version's batch answer is
    # one row, rewritten when its input or history changes; every distinct online answer is a row
    # of its own that nothing rewrites, because a client received it.
    sa.Column(
        "answer_key",
        sa.Text,
        primary_key=True,
        comment="batch: ''; online: input_hash|history_hash, one row per distinct answer",
    ),
    sa.Column("score", sa.Float(precision=53), nullable=False),
    sa.Column("run_id", sa.Text, nullable=True, comment="Dagster run (batch)"),
    sa.Column("partition_key", sa.Text, nullable=True, comment="Dagster partition (batch)"),
    sa.Column("request_id", sa.Text, nullable=True, comment="HTTP request (online)"),
    sa.Column("batch_id", sa.Text, nullable=True, comment="adaptive batch (online)"),
    sa.Column("code_version", sa.Text, nullable=False),
    sa.Column("input_hash", sa.Text, nullable=False),
    sa.Column(
        "history_hash",
        sa.Text,
        nullable=True,
        comment="digest of the stored records the features read as history; null when degraded",
    ),
    sa.Column("idempotency_key", sa.Text, nullable=True),
    sa.Column("produced_at", sa.DateTime(timezone=True), nullable=False),
    sa.Column("latency_ms", sa.Float, nullable=True, comment="online: service time of the producing request"),
    sa.Column(
        "degraded",
        sa.Boolean,
        nullable=False,
        server_default=sa.false(),
        comment="online: scored without account history (the store was unreachable)",
    ),
    sa.Column(
        "unseen_fields",
        sa.Text,
        nullable=True,
        comment="comma-separated fields scored through the unknown bucket; null = none",
    ),
    sa.CheckConstraint("path IN ('batch', 'online')", name="ck_predictions_path"),
    sa.Index("ix_predictions_partition_key", "partition_key"),
    sa.Index("ix_predictions_idempotency_key", "idempotency_key"),
)

idempotency_keys = sa.Table(
    "idempotency_keys",
    metadata,
    sa.Column("idempotency_key", sa.Text, primary_key=True),
    sa.Column("request_hash", sa.Text, nullable=False, comment="digest of the request's transactions, in order"),
    sa.Column("request_id", sa.Text, nullable=False, comment="the request that claimed the key"),
    sa.Column("response", sa.Text, nullable=True, comment="the answers as JSON; null while in flight"),
    sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
    sa.Column("completed_at", sa.DateTime(timezone=True), nullable=True),
)

rejected_records = sa.Table(
    "rejected_records",
    metadata,
    sa.Column("rejection_id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("rejection_key", sa.Text, nullable=False, unique=True),
    sa.Column("transaction_id", sa.Text, nullable=True),
    sa.Column("path", sa.Text, nullable=False),
    sa.Column("stage", sa.Text, nullable=False),
    sa.Column("partition_key", sa.Text, nullable=True),
    sa.Column("run_id", sa.Text, nullable=True),
    sa.Column("request_id", sa.Text, nullable=True),
    sa.Column("reason", sa.Text, nullable=False),
    sa.Column("detail", sa.Text, nullable=True),
    sa.Column("payload", sa.Text, nullable=False, comment="the record as received, JSON"),
    sa.Column("input_hash", sa.Text, nullable=False),
    sa.Column("first_seen", sa.DateTime(timezone=True), nullable=False),
    sa.Column("last_seen", sa.DateTime(timezone=True), nullable=False),
    sa.Column("seen_count", sa.Integer, nullable=False, server_default="1"),
    sa.Column("resolved", sa.Boolean, nullable=False, server_default=sa.false()),
    sa.Column("resolved_at", sa.DateTime(timezone=True), nullable=True),
    sa.Column("resolution", sa.Text, nullable=True, comment="operator (fixed upstream) | superseded"),
    sa.CheckConstraint("path IN ('batch', 'online')", name="ck_rejected_records_path"),
    sa.Index("ix_rejected_records_partition", "partition_key", "stage"),
)

# Stored rows as history for features: the record, its parsed time, and its hash (for the digest).
HISTORY_SCHEMA: dict[str, pl.DataType] = {**RAW_SCHEMA, "event_ts": EVENT_TS_DTYPE, "input_hash": pl.String()}

PREDICTION_COLUMNS: tuple[str, ...] = tuple(c.name for c in predictions.columns)
# Columns a writer may leave out: the merge derives answer_key, and the rest default.
_DERIVED_OR_DEFAULTED = {"answer_key": None, "degraded": False, "unseen_fields": None, "latency_ms": None}
NO_HISTORY = "nohistory"
# SQLite's default host-parameter limit is 32766; stay well below it per statement.
_SQLITE_ROWS_PER_STATEMENT = 500
# SQLite's default SQLITE_MAX_COMPOUND_SELECT is 500 terms per UNION ALL.
_TARGETS_PER_STATEMENT = 400


def make_engine(url: str, **kwargs: Any) -> Engine:
    """An engine with the settings each backend needs for concurrent writers."""
    if url.startswith("sqlite"):
        database = sa.engine.make_url(url).database
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
    return sa.create_engine(url, pool_pre_ping=True, **kwargs)


def utc_now() -> datetime:
    return datetime.now(UTC)


def _frame_from_rows(rows: Sequence[Any], schema: dict[str, pl.DataType]) -> pl.DataFrame:
    frame = pl.DataFrame([tuple(r) for r in rows], schema=schema, orient="row")
    if "event_ts" in frame.columns:
        frame = frame.with_columns(_as_utc(pl.col("event_ts")))
    return frame


def _as_utc(column: pl.Expr) -> pl.Expr:
    # SQLite hands back naive datetimes; every stored instant is UTC.
    return column.dt.replace_time_zone(None).dt.replace_time_zone("UTC")


# ------------------------------------------------------------------ transactions
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
        hash_inputs(checked),
    ).with_columns(
        partition_date=pl.lit(partition_date, dtype=pl.Date),
        ingested_at=pl.lit(now, dtype=EVENT_TS_DTYPE),
    )
    columns = [c.name for c in transactions.columns]
    keys = ["transaction_id"]
    return _merge(
        conn, transactions, frame.select(columns), keys, _overwrite_when_changed(transactions, keys, "input_hash")
    )


def read_partition_rows(conn: Connection, partition_date: date) -> pl.DataFrame:
    """The stored source rows of one day, in a stable order (RAW + event_ts + label + hash)."""
    stmt = (
        sa.select(
            *(transactions.c[name] for name in RAW_COLUMNS),
            transactions.c.event_ts,
            transactions.c.label_fraud,
        )
        .where(transactions.c.partition_date == partition_date)
        .order_by(transactions.c.account_id, transactions.c.event_ts, transactions.c.transaction_id)
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


def fetch_history(conn: Connection, targets: pl.DataFrame, history_length: int) -> pl.DataFrame:
    """For each target (account_id, event_ts, transaction_id): the valid stored rows of its account
    that sort before it, at most `history_length` each. One indexed LIMIT query per target, so
    the cost follows the request, never the account's total history."""
    schema = HISTORY_SCHEMA
    if targets.is_empty():
        return pl.DataFrame(schema=schema)
    columns = [*(transactions.c[name] for name in RAW_COLUMNS), transactions.c.event_ts, transactions.c.input_hash]
    t = transactions.c
    per_target = []
    for account_id, moment, transaction_id in targets.select("account_id", "event_ts", "transaction_id").iter_rows():
        per_target.append(
            sa.select(*columns)
            .where(
                t.account_id == account_id,
                t.reject_reason.is_(None),
                sa.or_(t.event_ts < moment, sa.and_(t.event_ts == moment, t.transaction_id < transaction_id)),
            )
            .order_by(t.event_ts.desc(), t.transaction_id.desc())
            .limit(history_length)
            .subquery()
            .select()
        )
    # SQLite refuses a compound SELECT of more than 500 terms, so large target sets go in groups.
    frames = []
    for group in _chunks(per_target, _TARGETS_PER_STATEMENT):
        statement: sa.Executable = group[0] if len(group) == 1 else sa.union_all(*group)
        frames.append(_frame_from_rows(conn.execute(statement).all(), schema))
    return pl.concat(frames).unique("transaction_id", keep="first", maintain_order=True)


def prior_history(conn: Connection, account_ids: Sequence[str], before: date, history_length: int) -> pl.DataFrame:
    """The last `history_length` valid rows per account from days before `before` (batch path)."""
    schema = HISTORY_SCHEMA
    t = transactions.c
    frames = []
    for chunk in _chunks(list(account_ids), 1000):
        ranked = (
            sa.select(
                *(t[name] for name in RAW_COLUMNS),
                t.event_ts,
                t.input_hash,
                sa.func.row_number()
                .over(partition_by=t.account_id, order_by=(t.event_ts.desc(), t.transaction_id.desc()))
                .label("recency"),
            )
            .where(t.account_id.in_(chunk), t.partition_date < before, t.reject_reason.is_(None))
            .subquery()
        )
        stmt = sa.select(*(ranked.c[name] for name in HISTORY_SCHEMA)).where(ranked.c.recency <= history_length)
        frames.append(_frame_from_rows(conn.execute(stmt).all(), schema))
    return pl.concat(frames) if frames else pl.DataFrame(schema=schema)


# ------------------------------------------------------------------ predictions
def _polars_type(column: sa.Column[Any]) -> pl.DataType:
    if isinstance(column.type, sa.Float):
        return pl.Float64()
    if isinstance(column.type, sa.DateTime):
        return EVENT_TS_DTYPE
    if isinstance(column.type, sa.Boolean):
        return pl.Boolean()
    return pl.String()


PREDICTION_SCHEMA: dict[str, pl.DataType] = {c.name: _polars_type(c) for c in predictions.columns}


def prediction_frame(rows: Sequence[dict[str, Any]]) -> pl.DataFrame:
    """Result rows (dicts, as the online path builds them) as a frame of `predictions` columns;
    the optional columns may be absent."""
    return pl.DataFrame(
        [{name: row.get(name, _DERIVED_OR_DEFAULTED.get(name)) for name in PREDICTION_COLUMNS} for row in rows],
        schema=PREDICTION_SCHEMA,
    )


def answer_key_expr() -> pl.Expr:
    """The row's place in the key: '' for a batch answer (one per version, rewritten on change);
    input and history for an online one, so each distinct answer a client received is kept."""
    online_key = pl.concat_str([pl.col("input_hash"), pl.col("history_hash").fill_null(NO_HISTORY)], separator="|")
    return pl.when(pl.col("path") == ResultPath.BATCH.value).then(pl.lit("")).otherwise(online_key).alias("answer_key")


def upsert_predictions(conn: Connection, rows: pl.DataFrame) -> int:
    """Write prediction rows idempotently; returns rows inserted or changed.

    Keyed by (transaction_id, model_version, path, answer_key), so one path never touches what the
    other recorded:
    - a batch answer is rewritten when the record or the history it read changed (a correction,
      a late earlier record); the same input again (a rerun, a retry) is a no-op;
    - an online answer is never rewritten: the same key means the same input and history, i.e.
      the same answer replayed.
    """
    if rows.is_empty():
        return 0
    missing = [
        pl.lit(default, dtype=PREDICTION_SCHEMA[name]).alias(name)
        for name, default in _DERIVED_OR_DEFAULTED.items()
        if name not in rows.columns
    ]
    frame = (
        rows.with_columns(*missing)
        .with_columns(answer_key_expr(), pl.col("degraded").cast(pl.Boolean).fill_null(False))
        .select(PREDICTION_COLUMNS)
        .unique(["transaction_id", "model_version", "path", "answer_key"], keep="last")
    )
    return _merge(
        conn, predictions, frame, ["transaction_id", "model_version", "path", "answer_key"], _prediction_conflict
    )


def _prediction_conflict(excluded: Any) -> tuple[dict[str, Any], Any]:
    p = predictions.c
    # A batch score is a function of the record and of the history it read: either changing rewrites it.
    changed = sa.or_(p.input_hash != excluded.input_hash, p.history_hash.is_distinct_from(excluded.history_hash))
    key = ("transaction_id", "model_version", "path", "answer_key")
    set_ = {name: excluded[name] for name in PREDICTION_COLUMNS if name not in key}
    return set_, sa.and_(excluded.path == ResultPath.BATCH.value, changed)


def read_predictions(conn: Connection, **equal_to: Any) -> pl.DataFrame:
    stmt = sa.select(predictions).order_by(
        predictions.c.transaction_id, predictions.c.model_version, predictions.c.path, predictions.c.produced_at
    )
    for name, value in equal_to.items():
        stmt = stmt.where(predictions.c[name] == value)
    frame = _frame_from_rows(conn.execute(stmt).all(), PREDICTION_SCHEMA)
    return frame.with_columns(_as_utc(pl.col("produced_at")))


# ------------------------------------------------------------------ quarantine
def quarantine_unwritable_result(conn: Connection, row: dict[str, Any], error: str, *, path: ResultPath) -> None:
    """Keep a result row the store refused (a data error, not an outage) as a rejection, so it is
    seen and kept instead of blocking the rows behind it. Text is made storable first (PostgreSQL
    text cannot hold NUL), because the payload must land even when the original could not."""

    def storable(value: Any) -> Any:
        return value.replace("\x00", "\\x00") if isinstance(value, str) else value

    # json.dumps writes NUL as the six characters \u0000, which text columns hold.
    payload = json.dumps(row, sort_keys=True, default=str, allow_nan=True)
    transaction_id = storable(row.get("transaction_id"))
    digest = hashlib.sha256(payload.encode()).hexdigest()[:32]
    key = "|".join([path.value, RejectStage.WRITE.value, str(transaction_id), digest])
    now = utc_now()
    insert = _insert_for(conn, rejected_records)
    conn.execute(
        insert.values(
            rejection_key=hashlib.sha256(key.encode()).hexdigest()[:40],
            transaction_id=transaction_id,
            path=path.value,
            stage=RejectStage.WRITE.value,
            request_id=storable(row.get("request_id")),
            reason=UNWRITABLE_RESULT,
            detail=storable(error)[:500],
            payload=payload,
            input_hash=storable(str(row.get("input_hash"))),
            first_seen=now,
            last_seen=now,
            seen_count=1,
            resolved=False,
        ).on_conflict_do_update(
            index_elements=["rejection_key"],
            set_={"last_seen": insert.excluded.last_seen, "seen_count": rejected_records.c.seen_count + 1},
        )
    )


def quarantine(
    conn: Connection,
    rejected: pl.DataFrame,
    *,
    path: ResultPath,
    stage: RejectStage,
    partition_key: str | None = None,
    run_id: str | None = None,
    request_id: str | None = None,
) -> int:
    """Record rejected rows (RAW columns + reject_reason [+ reject_detail]) with their reason.

    The same record rejected again for the same reason (a rerun) updates `last_seen` instead of
    adding a row; a changed record is a new rejection.
    """
    if rejected.is_empty():
        return 0
    now = utc_now()
    hashes = hash_inputs(rejected)
    details = rejected["reject_detail"].to_list() if "reject_detail" in rejected.columns else [None] * rejected.height
    records = []
    raw_rows = rejected.select(RAW_COLUMNS).to_dicts()
    for raw, reason, detail, digest in zip(
        raw_rows, rejected["reject_reason"].to_list(), details, hashes.to_list(), strict=True
    ):
        key = "|".join([path.value, stage.value, str(raw["transaction_id"]), str(reason), digest])
        records.append(
            {
                "rejection_key": hashlib.sha256(key.encode()).hexdigest()[:40],
                "transaction_id": raw["transaction_id"],
                "path": path.value,
                "stage": stage.value,
                "partition_key": partition_key,
                "run_id": run_id,
                "request_id": request_id,
                "reason": reason,
                "detail": detail,
                "payload": json.dumps(raw, sort_keys=True, default=str, allow_nan=True),
                "input_hash": digest,
                "first_seen": now,
                "last_seen": now,
                "seen_count": 1,
                "resolved": False,
                "resolved_at": None,
            }
        )
    insert = _insert_for(conn, rejected_records)
    stmt = insert.on_conflict_do_update(
        index_elements=["rejection_key"],
        set_={
            "last_seen": insert.excluded.last_seen,
            "seen_count": rejected_records.c.seen_count + 1,
            "run_id": insert.excluded.run_id,
        },
    )
    for chunk in _chunks(records, _SQLITE_ROWS_PER_STATEMENT):
        conn.execute(stmt, chunk)
    return len(records)


def count_rejected(conn: Connection, *, partition_key: str, stage: RejectStage | None = None) -> int:
    stmt = (
        sa.select(sa.func.count())
        .select_from(rejected_records)
        .where(rejected_records.c.partition_key == partition_key)
    )
    if stage is not None:
        stmt = stmt.where(rejected_records.c.stage == stage.value)
    return int(conn.execute(stmt).scalar_one())


# ------------------------------------------------------------------ merge machinery
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

    PostgreSQL: COPY into a temporary staging table, then one INSERT ... SELECT ... ON CONFLICT in
    key order (a fixed lock order, so concurrent merges cannot deadlock). SQLite: batched
    INSERT ... ON CONFLICT DO UPDATE. Either way the caller's transaction decides atomicity.
    """
    if conn.dialect.name == "postgresql":
        staging = _copy_to_staging(conn, table, frame)
        source = sa.select(*(staging.c[name] for name in frame.columns)).order_by(*(staging.c[k] for k in keys))
        merge = postgresql.insert(table).from_select(list(frame.columns), source)
        set_, where = on_conflict(merge.excluded)
        statement = merge.on_conflict_do_update(index_elements=keys, set_=set_, where=where)
        return int(conn.execute(statement, execution_options={"preserve_rowcount": True}).rowcount)
    upsert = sqlite.insert(table)
    set_, where = on_conflict(upsert.excluded)
    statement_sqlite = upsert.on_conflict_do_update(index_elements=keys, set_=set_, where=where)
    changed = 0
    for chunk in _chunks(_python_rows(frame), _SQLITE_ROWS_PER_STATEMENT):
        changed += conn.execute(statement_sqlite, chunk).rowcount
    return changed


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
    frame.write_csv(buffer, include_header=False, null_value="\\N", datetime_format="%Y-%m-%dT%H:%M:%S.%6f%z")
    driver_cursor = conn.connection.driver_connection.cursor()  # type: ignore[union-attr]
    try:
        with driver_cursor.copy(f"COPY {staging} ({quoted}) FROM STDIN WITH (FORMAT csv, NULL '\\N')") as copy:
            copy.write(buffer.getvalue())
    finally:
        driver_cursor.close()
    return sa.table(staging, *(sa.column(name, table.c[name].type) for name in frame.columns))


def _python_rows(frame: pl.DataFrame) -> list[dict[str, Any]]:
    return frame.to_dicts()


def _chunks(items: Sequence[Any] | Iterable[Any], size: int) -> Iterator[list[Any]]:
    batch: list[Any] = []
    for item in items:
        batch.append(item)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


class StoreHistory:
    """History read from the `transactions` table, for callers that hold single records."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def history_for(self, targets: pl.DataFrame, history_length: int) -> pl.DataFrame:
        with self.engine.connect() as conn:
            return fetch_history(conn, targets, history_length)


def delete_batch_predictions(
    conn: Connection, *, partition_key: str, model_version: str, transaction_ids: list[str]
) -> int:
    """Drop batch predictions of records that a rerun now rejects (a correction made them invalid)."""
    deleted = 0
    for chunk in _chunks(transaction_ids, 1000):
        deleted += conn.execute(
            sa.delete(predictions).where(
                predictions.c.partition_key == partition_key,
                predictions.c.model_version == model_version,
                predictions.c.path == ResultPath.BATCH.value,
                predictions.c.transaction_id.in_(chunk),
            )
        ).rowcount
    return deleted


def stream_partition_rows(engine: Engine, partition_date: date, chunk_rows: int) -> Iterator[pl.DataFrame]:
    """A day's stored rows in chunks, ordered by account so each account's rows are contiguous.

    A server-side cursor keeps memory flat in the partition size (PostgreSQL); SQLite's cursor is
    lazy already.
    """
    t = transactions.c
    stmt = (
        sa.select(*(t[name] for name in RAW_COLUMNS), t.event_ts, t.label_fraud, t.input_hash)
        .where(t.partition_date == partition_date)
        .order_by(t.account_id, t.event_ts, t.transaction_id)
    )
    schema = {**RAW_SCHEMA, "event_ts": EVENT_TS_DTYPE, "label_fraud": pl.Int16(), "input_hash": pl.String()}
    with engine.connect() as conn:
        result = conn.execution_options(stream_results=True, yield_per=chunk_rows).execute(stmt)
        for rows in result.partitions(chunk_rows):
            yield _frame_from_rows(rows, schema)


def resolve_superseded_rejections(conn: Connection, *, partition_key: str) -> int:
    """Mark a partition's scoring rejections resolved once their record has changed (a correction):
    the quarantined input no longer exists, so it no longer counts against the partition."""
    r, t = rejected_records.c, transactions.c
    changed = sa.select(t.transaction_id).where(t.transaction_id == r.transaction_id, t.input_hash != r.input_hash)
    stmt = (
        sa.update(rejected_records)
        .where(
            r.partition_key == partition_key,
            r.stage == RejectStage.SCORE.value,
            r.resolved.is_(False),
            changed.exists(),
        )
        .values(resolved=True, resolved_at=utc_now(), resolution=Resolution.SUPERSEDED.value)
    )
    return int(conn.execute(stmt).rowcount)


@dataclass(frozen=True)
class PartitionCounts:
    """What the batch asset checks compare, read back from the tables after the merge."""

    input_rows: int
    scored: int
    rejected: int
    scores_out_of_range: int
    stale_answers: int  # batch answers whose input is no longer the stored record's
    answered_online: int  # input rows that the online path answered too (never skipped by batch)


def partition_counts(
    conn: Connection, *, partition_date: date, partition_key: str, model_version: str
) -> PartitionCounts:
    p, r, t = predictions.c, rejected_records.c, transactions.c
    batch_rows = sa.and_(
        p.partition_key == partition_key, p.model_version == model_version, p.path == ResultPath.BATCH.value
    )
    input_rows = conn.execute(sa.select(sa.func.count()).where(t.partition_date == partition_date)).scalar_one()
    scored = conn.execute(sa.select(sa.func.count()).select_from(predictions).where(batch_rows)).scalar_one()
    rejected = conn.execute(
        sa.select(sa.func.count(sa.distinct(r.transaction_id))).where(
            r.partition_key == partition_key, r.stage == RejectStage.SCORE.value, r.resolved.is_(False)
        )
    ).scalar_one()
    # NaN compares greater than every number in PostgreSQL, so this also catches non-finite scores.
    out_of_range = conn.execute(
        sa.select(sa.func.count())
        .select_from(predictions)
        .where(batch_rows, sa.not_(sa.and_(p.score >= 0, p.score <= 1)))
    ).scalar_one()
    stale = conn.execute(
        sa.select(sa.func.count())
        .select_from(predictions.join(transactions, p.transaction_id == t.transaction_id, isouter=True))
        .where(batch_rows, sa.or_(t.input_hash.is_(None), t.input_hash != p.input_hash))
    ).scalar_one()
    answered_online = conn.execute(
        sa.select(sa.func.count(sa.distinct(t.transaction_id)))
        .select_from(transactions.join(predictions, p.transaction_id == t.transaction_id))
        .where(t.partition_date == partition_date, p.path == ResultPath.ONLINE.value)
    ).scalar_one()
    return PartitionCounts(
        int(input_rows), int(scored), int(rejected), int(out_of_range), int(stale), int(answered_online)
    )


def stored_partition_dates(conn: Connection) -> list[date]:
    stmt = sa.select(transactions.c.partition_date).distinct().order_by(transactions.c.partition_date)
    return [row[0] if isinstance(row[0], date) else date.fromisoformat(str(row[0])) for row in conn.execute(stmt)]


def sample_batch_predictions(conn: Connection, *, partition_key: str, model_version: str, size: int) -> pl.DataFrame:
    """A deterministic pseudo-random sample (ordered by input hash) of a partition's batch scores,
    with the stored source rows they came from (RAW columns + event_ts + score)."""
    p, t = predictions.c, transactions.c
    stmt = (
        sa.select(*(t[name] for name in RAW_COLUMNS), t.event_ts, p.score)
        .join_from(predictions, transactions, p.transaction_id == t.transaction_id)
        .where(p.partition_key == partition_key, p.model_version == model_version, p.path == ResultPath.BATCH.value)
        .order_by(p.input_hash)
        .limit(size)
    )
    schema = {**RAW_SCHEMA, "event_ts": EVENT_TS_DTYPE, "score": pl.Float64()}
    return _frame_from_rows(conn.execute(stmt).all(), schema)


# ------------------------------------------------------------------ what the sensors watch
@dataclass(frozen=True)
class PartitionChange:
    partition_key: str
    watermark: datetime  # the newest change seen in this partition; part of the run key


def _aware(moment: Any) -> datetime:
    value = moment if isinstance(moment, datetime) else datetime.fromisoformat(str(moment))
    return value if value.tzinfo else value.replace(tzinfo=UTC)


def stale_scored_partitions(
    conn: Connection, *, changed_after: datetime | None, history_length: int
) -> list[PartitionChange]:
    """Partitions already scored by the batch path whose scores a change made stale.

    A change is a record changed (late or corrected) after `changed_after` whose current contents
    have no batch result yet: no batch prediction and no open rejection for its current input hash. Stale are
    the change's own partition and the partitions of the account's next `history_length` valid
    records, whose features read (or, for a record now invalid, read) the changed one as history.
    Every such partition, however many changed in the same interval, is returned, with the newest
    change that touched it.

    Not covered: a correction that moves a record's event time leaves the records that followed
    its old position unscheduled (the old position is no longer stored).
    """
    t, p, r = transactions.c, predictions.c, rejected_records.c
    changed_filter = [
        # Only a batch answer counts: an online answer to the corrected body leaves the batch stale.
        ~sa.select(p.transaction_id)
        .where(p.transaction_id == t.transaction_id, p.input_hash == t.input_hash, p.path == ResultPath.BATCH.value)
        .exists(),
        ~sa.select(r.rejection_id)
        .where(r.transaction_id == t.transaction_id, r.input_hash == t.input_hash, r.resolved.is_(False))
        .exists(),
    ]
    if changed_after is not None:
        changed_filter.append(t.ingested_at > changed_after)
    changed = (
        sa.select(t.transaction_id, t.account_id, t.partition_date, t.ingested_at).where(*changed_filter).cte("changed")
    )
    # The affected accounts' records in history order: valid ones (what features read) and the
    # changed ones themselves, numbered per account.
    timeline = (
        sa.select(
            t.transaction_id,
            t.account_id,
            t.partition_date,
            sa.func.row_number()
            .over(partition_by=t.account_id, order_by=(t.event_ts, t.transaction_id))
            .label("position"),
        )
        .where(
            t.account_id.in_(sa.select(changed.c.account_id)),
            sa.or_(t.reject_reason.is_(None), t.transaction_id.in_(sa.select(changed.c.transaction_id))),
        )
        .cte("timeline")
    )
    at, later = timeline.alias("at_change"), timeline.alias("later")
    downstream = (
        sa.select(later.c.partition_date, changed.c.ingested_at)
        .select_from(changed)
        .join(at, at.c.transaction_id == changed.c.transaction_id)
        .join(
            later,
            sa.and_(
                later.c.account_id == at.c.account_id,
                later.c.position > at.c.position,
                later.c.position <= at.c.position + history_length,
            ),
        )
    )
    touched = sa.union_all(sa.select(changed.c.partition_date, changed.c.ingested_at), downstream).subquery("touched")
    batch_scored = (
        sa.select(p.transaction_id)
        .where(p.partition_key == sa.cast(touched.c.partition_date, sa.String), p.path == ResultPath.BATCH.value)
        .exists()
    )
    stmt = (
        sa.select(touched.c.partition_date, sa.func.max(touched.c.ingested_at))
        .where(batch_scored)
        .group_by(touched.c.partition_date)
        .order_by(touched.c.partition_date)
    )
    return [PartitionChange(str(day), _aware(moment)) for day, moment in conn.execute(stmt)]


def fixed_rejection_partitions(conn: Connection, *, resolved_after: datetime | None) -> list[PartitionChange]:
    """Partitions whose quarantined batch records an operator marked fixed after `resolved_after`."""
    r = rejected_records.c
    stmt = (
        sa.select(r.partition_key, sa.func.max(r.resolved_at))
        .where(
            r.path == ResultPath.BATCH.value,
            r.resolved.is_(True),
            r.resolution == Resolution.OPERATOR.value,
            r.partition_key.is_not(None),
        )
        .group_by(r.partition_key)
        .order_by(r.partition_key)
    )
    if resolved_after is not None:
        stmt = stmt.where(r.resolved_at > resolved_after)
    return [PartitionChange(str(key), _aware(moment)) for key, moment in conn.execute(stmt)]


def mark_rejections_fixed(conn: Connection, rejection_ids: Sequence[int]) -> int:
    """An operator's word that the source of these rejected records was fixed."""
    stmt = (
        sa.update(rejected_records)
        .where(rejected_records.c.rejection_id.in_(list(rejection_ids)), rejected_records.c.resolved.is_(False))
        .values(resolved=True, resolved_at=utc_now(), resolution=Resolution.OPERATOR.value)
    )
    return int(conn.execute(stmt).rowcount)


def scored_partition_keys(conn: Connection) -> list[str]:
    stmt = (
        sa.select(predictions.c.partition_key)
        .where(predictions.c.path == ResultPath.BATCH.value, predictions.c.partition_key.is_not(None))
        .distinct()
        .order_by(predictions.c.partition_key)
    )
    return [str(key) for (key,) in conn.execute(stmt)]


def lineage_rows(conn: Connection, transaction_id: str) -> tuple[dict[str, Any] | None, list[dict[str, Any]]]:
    """The stored source record (or None) and every prediction row of one transaction."""
    source = (
        conn.execute(sa.select(transactions).where(transactions.c.transaction_id == transaction_id)).mappings().first()
    )
    results = conn.execute(
        sa.select(predictions).where(predictions.c.transaction_id == transaction_id).order_by(predictions.c.produced_at)
    ).mappings()
    return (dict(source) if source else None), [dict(row) for row in results]


@dataclass(frozen=True)
class OnlineActivity:
    rows: int
    requests: int
    model_versions: dict[str, int]
    latency_ms_p50: float | None
    latency_ms_p99: float | None
    latest: datetime | None


def online_activity(conn: Connection, *, produced_after: datetime | None) -> OnlineActivity:
    """What the online path wrote since `produced_after`, for the online_predictions observations."""
    p = predictions.c
    where = [p.path == ResultPath.ONLINE.value]
    if produced_after is not None:
        where.append(p.produced_at > produced_after)
    rows = conn.execute(sa.select(p.model_version, p.request_id, p.latency_ms, p.produced_at).where(*where)).all()
    if not rows:
        return OnlineActivity(0, 0, {}, None, None, None)
    frame = pl.DataFrame(
        [tuple(r) for r in rows],
        schema={
            "model_version": pl.String(),
            "request_id": pl.String(),
            "latency_ms": pl.Float64(),
            "produced_at": EVENT_TS_DTYPE,
        },
        orient="row",
    ).with_columns(_as_utc(pl.col("produced_at")))
    versions = frame.group_by("model_version").len().sort("model_version")
    latency = frame["latency_ms"].drop_nulls()
    latest = frame["produced_at"].max()
    return OnlineActivity(
        rows=frame.height,
        requests=frame["request_id"].n_unique(),
        model_versions=dict(zip(versions["model_version"].to_list(), versions["len"].to_list(), strict=True)),
        latency_ms_p50=float(latency.quantile(0.5) or 0.0) if latency.len() else None,
        latency_ms_p99=float(latency.quantile(0.99) or 0.0) if latency.len() else None,
        latest=latest if isinstance(latest, datetime) else None,
    )


# ------------------------------------------------------------------ online answers, idempotency keys
def online_answers(conn: Connection, *, model_version: str, transaction_ids: Sequence[str]) -> list[dict[str, Any]]:
    """Stored online answers of these transactions under one model version (for replays)."""
    p = predictions.c
    stmt = sa.select(predictions).where(
        p.model_version == model_version, p.path == ResultPath.ONLINE.value, p.transaction_id.in_(list(transaction_ids))
    )
    return [dict(row._mapping) for row in conn.execute(stmt)]


@dataclass(frozen=True)
class KeyClaim:
    """The store's word on an idempotency key: who holds it, for which body, and its answer if done."""

    request_hash: str
    request_id: str
    response: str | None
    created_at: datetime

    def owned_by(self, request_id: str) -> bool:
        return self.request_id == request_id


def claim_idempotency_key(conn: Connection, *, key: str, request_hash: str, request_id: str) -> KeyClaim:
    """Claim `key` for this request body unless some request (any process) already did; returns
    the claim that stands. Atomic on both backends: INSERT ... ON CONFLICT DO NOTHING, then read."""
    insert = _insert_for(conn, idempotency_keys)
    conn.execute(
        insert.values(
            idempotency_key=key, request_hash=request_hash, request_id=request_id, created_at=utc_now()
        ).on_conflict_do_nothing(index_elements=["idempotency_key"])
    )
    k = idempotency_keys.c
    row = conn.execute(
        sa.select(k.request_hash, k.request_id, k.response, k.created_at).where(k.idempotency_key == key)
    ).one()
    return KeyClaim(row.request_hash, row.request_id, row.response, _aware(row.created_at))


def complete_idempotency_key(conn: Connection, *, key: str, request_id: str, response: str) -> None:
    k = idempotency_keys.c
    conn.execute(
        sa.update(idempotency_keys)
        .where(k.idempotency_key == key, k.request_id == request_id, k.response.is_(None))
        .values(response=response, completed_at=utc_now())
    )


def release_idempotency_key(conn: Connection, *, key: str, request_id: str) -> None:
    """Give up an unanswered claim (the request was shed or expired), so a retry may score."""
    k = idempotency_keys.c
    conn.execute(
        sa.delete(idempotency_keys).where(k.idempotency_key == key, k.request_id == request_id, k.response.is_(None))
    )


def take_over_idempotency_key(conn: Connection, *, key: str, request_id: str, claimed_before: datetime) -> bool:
    """Move an unanswered claim older than `claimed_before` (its process died) to this request."""
    k = idempotency_keys.c
    stmt = (
        sa.update(idempotency_keys)
        .where(k.idempotency_key == key, k.response.is_(None), k.created_at < claimed_before)
        .values(request_id=request_id, created_at=utc_now())
    )
    return bool(conn.execute(stmt).rowcount)


# ------------------------------------------------------------------ path agreement
ANSWER_PAIR_SCHEMA: dict[str, pl.DataType] = {
    "transaction_id": pl.String(),
    "online_model_version": pl.String(),
    "online_answer_key": pl.String(),
    "online_score": pl.Float64(),
    "online_input_hash": pl.String(),
    "online_history_hash": pl.String(),
    "online_degraded": pl.Boolean(),
    "online_request_id": pl.String(),
    "online_produced_at": EVENT_TS_DTYPE,
    # Null when the transaction has no batch answer (yet): not scored, or rejected by batch.
    "batch_model_version": pl.String(),
    "batch_score": pl.Float64(),
    "batch_input_hash": pl.String(),
    "batch_history_hash": pl.String(),
    "batch_run_id": pl.String(),
    "batch_produced_at": EVENT_TS_DTYPE,
}


def answer_pairs(conn: Connection, partition_date: date) -> pl.DataFrame:
    """Every online answer to a transaction stored in `partition_date`, beside the batch answer it
    is compared with (ANSWER_PAIR_SCHEMA): the batch answer under the same model version if there
    is one, else the transaction's newest batch answer. Several online answers to one transaction
    (retries with a changed body, other model versions) are several pairs."""
    t = transactions.c
    online, batch, candidate = predictions.alias("online"), predictions.alias("batch"), predictions.alias("candidate")
    o, b, c = online.c, batch.c, candidate.c
    is_batch = sa.and_(c.transaction_id == o.transaction_id, c.path == ResultPath.BATCH.value)
    same_version = sa.select(c.model_version).where(is_batch, c.model_version == o.model_version).scalar_subquery()
    newest = (
        sa.select(c.model_version)
        .where(is_batch)
        .order_by(c.produced_at.desc(), c.model_version.desc())
        .limit(1)
        .scalar_subquery()
    )
    paired = sa.and_(
        b.transaction_id == o.transaction_id,
        b.path == ResultPath.BATCH.value,
        b.answer_key == "",
        b.model_version == sa.func.coalesce(same_version, newest),
    )
    stmt = (
        sa.select(
            o.transaction_id,
            o.model_version,
            o.answer_key,
            o.score,
            o.input_hash,
            o.history_hash,
            o.degraded,
            o.request_id,
            o.produced_at,
            b.model_version,
            b.score,
            b.input_hash,
            b.history_hash,
            b.run_id,
            b.produced_at,
        )
        .select_from(online.join(transactions, t.transaction_id == o.transaction_id).outerjoin(batch, paired))
        .where(t.partition_date == partition_date, o.path == ResultPath.ONLINE.value)
        .order_by(o.transaction_id, o.produced_at, o.model_version, o.answer_key)
    )
    frame = _frame_from_rows(conn.execute(stmt).all(), ANSWER_PAIR_SCHEMA)
    return frame.with_columns(_as_utc(pl.col("online_produced_at")), _as_utc(pl.col("batch_produced_at")))
