"""`predictions`: the one builder of a result row both paths use, the idempotent upsert, and the
reads of stored answers (replays, lineage, the online/batch pairs that path_agreement compares).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import date, datetime
from typing import Any, overload

import polars as pl
import sqlalchemy as sa
from sqlalchemy.engine import Connection

from inference.records import EVENT_TS_DTYPE, run_query
from inference.spec import LoadedSpec
from inference.store.engine import _as_utc, _chunks, _frame_from_rows
from inference.store.merge import _merge
from inference.store.record_table import record_table
from inference.store.schema import (
    NO_HISTORY,
    PREDICTION_COLUMNS,
    PREDICTION_SCHEMA,
    ResultPath,
    predictions,
)

# Two scores this close are one answer: float noise between forward batch sizes and thread counts.
# The parity check and path_agreement compare with it; a batch rewrite needs a larger change.
PARITY_TOLERANCE = 1e-5

# Ids per DELETE ... IN: within SQLite's (32,766) and PostgreSQL's (65,535) parameter limits.
DELETE_IDS_PER_STATEMENT = 10_000

# Columns a writer may leave out: the merge derives answer_key, and the rest default.
_DERIVED_OR_DEFAULTED = {"answer_key": None, "degraded": False, "unseen_fields": None, "latency_ms": None}


# ------------------------------------------------------------------ building rows
@dataclass(frozen=True)
class BatchProducer:
    """Lineage of a batch write: which run wrote it, for which partition, from which code."""

    run_id: str
    partition_key: str
    code_version: str


@dataclass(frozen=True)
class OnlineProducer:
    """Lineage of an online answer: the request it answered, the adaptive batch that scored it,
    from which code."""

    request_id: str
    batch_id: str
    code_version: str


# What a row copies from the Predictor's result (contract.RESULT_SCHEMA) as it is.
_FROM_RESULT = ("record_id", "score", "input_hash", "history_hash", "unseen_fields")
# Every column a builder fills: all of them but answer_key, which the upsert derives.
ROW_COLUMNS: tuple[str, ...] = tuple(name for name in PREDICTION_COLUMNS if name != "answer_key")


@overload
def prediction_rows(
    scored: pl.DataFrame,
    *,
    producer: BatchProducer | OnlineProducer,
    model_version: str,
    produced_at: datetime,
    degraded: bool = False,
    idempotency_key: str | None = None,
) -> pl.DataFrame: ...


@overload
def prediction_rows(
    scored: Mapping[str, Any],
    *,
    producer: BatchProducer | OnlineProducer,
    model_version: str,
    produced_at: datetime,
    degraded: bool = False,
    idempotency_key: str | None = None,
) -> dict[str, Any]: ...


def prediction_rows(
    scored: pl.DataFrame | Mapping[str, Any],
    *,
    producer: BatchProducer | OnlineProducer,
    model_version: str,
    produced_at: datetime,
    degraded: bool = False,
    idempotency_key: str | None = None,
) -> pl.DataFrame | dict[str, Any]:
    """The `predictions` rows (ROW_COLUMNS) of scored results, with their lineage: the one place
    that says what a row holds, for both paths.

    `scored` is the Predictor's output for scored rows: a frame (the batch path's chunk) gives a
    frame; one result row (an online item) gives one row as a dict, which costs a dict and not a
    polars frame (about 0.4 ms however small), since the service builds it on the latency path.
    A degraded answer read an empty history, not the account's: its history_hash is unknown.
    """
    if isinstance(producer, BatchProducer):
        path, run_id, partition_key = ResultPath.BATCH.value, producer.run_id, producer.partition_key
        request_id: str | None = None
        batch_id: str | None = None
    else:
        path, run_id, partition_key = ResultPath.ONLINE.value, None, None
        request_id, batch_id = producer.request_id, producer.batch_id
    lineage: dict[str, Any] = {
        "model_version": model_version,
        "path": path,
        "run_id": run_id,
        "partition_key": partition_key,
        "request_id": request_id,
        "batch_id": batch_id,
        "code_version": producer.code_version,
        "idempotency_key": idempotency_key,
        "produced_at": produced_at,
        "latency_ms": None,  # online: the service adds its measured time once the request is answered
        "degraded": degraded,
    }
    if isinstance(scored, pl.DataFrame):
        columns: dict[str, pl.Expr] = {name: pl.col(name) for name in _FROM_RESULT}
        if degraded:
            columns["history_hash"] = pl.lit(None, dtype=pl.String).alias("history_hash")
        columns |= {name: pl.lit(value, dtype=PREDICTION_SCHEMA[name]).alias(name) for name, value in lineage.items()}
        return scored.select(*(columns[name] for name in ROW_COLUMNS))
    return {
        "record_id": scored["record_id"],
        "score": float(scored["score"]),
        "input_hash": scored["input_hash"],
        "history_hash": None if degraded else scored["history_hash"],
        "unseen_fields": scored["unseen_fields"],
        **lineage,
    }


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


# ------------------------------------------------------------------ writes
def upsert_predictions(conn: Connection, rows: pl.DataFrame, *, table: sa.Table = predictions) -> int:
    """Write prediction rows idempotently; returns rows inserted or changed. `table` is
    `predictions`, or `challenger_predictions`, which has the same columns and rules.

    Keyed by (record_id, model_version, path, answer_key), so one path never touches what the
    other recorded:
    - a batch answer is rewritten when the record or the history it read changed (a correction,
      a late earlier record), or when the score did (the same model under changed feature or
      scoring code: the rescore a bumped code version asks for); the same answer again (a rerun,
      a retry) is a no-op;
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
    frame = run_query(
        rows.lazy()
        .with_columns(*missing)
        .with_columns(answer_key_expr(), pl.col("degraded").cast(pl.Boolean).fill_null(False))
        .select(PREDICTION_COLUMNS)
        .unique(["record_id", "model_version", "path", "answer_key"], keep="last")
    )
    key = ["record_id", "model_version", "path", "answer_key"]
    return _merge(conn, table, frame, key, _conflict_policy(table))


@functools.cache
def _conflict_policy(table: sa.Table) -> Any:
    """One policy object per table, so the merge's statement cache finds it again."""
    return functools.partial(_prediction_conflict, table)


def _prediction_conflict(table: sa.Table, excluded: Any) -> tuple[dict[str, Any], Any]:
    p = table.c
    # A batch score is a function of the record, the history it read and the code that scored it.
    # The code's version on the row is the git revision, which moves with every commit: comparing
    # the score itself rewrites a row only when a change of code changed its answer.
    changed = sa.or_(
        p.input_hash != excluded.input_hash,
        p.history_hash.is_distinct_from(excluded.history_hash),
        sa.func.abs(p.score - excluded.score) > PARITY_TOLERANCE,
    )
    key = ("record_id", "model_version", "path", "answer_key")
    set_ = {name: excluded[name] for name in PREDICTION_COLUMNS if name not in key}
    return set_, sa.and_(excluded.path == ResultPath.BATCH.value, changed)


def delete_batch_predictions(
    conn: Connection,
    *,
    partition_key: str,
    model_version: str,
    record_ids: list[str],
    table: sa.Table = predictions,
) -> int:
    """Drop batch predictions of records that a rerun now rejects (a correction made them invalid).
    One statement per DELETE_IDS_PER_STATEMENT ids: each may scan the whole partition."""
    deleted = 0
    for chunk in _chunks(record_ids, DELETE_IDS_PER_STATEMENT):
        deleted += conn.execute(
            sa.delete(table).where(
                table.c.partition_key == partition_key,
                table.c.model_version == model_version,
                table.c.path == ResultPath.BATCH.value,
                table.c.record_id.in_(chunk),
            )
        ).rowcount
    return deleted


# ------------------------------------------------------------------ reads
def read_predictions(conn: Connection, **equal_to: Any) -> pl.DataFrame:
    stmt = sa.select(predictions).order_by(
        predictions.c.record_id, predictions.c.model_version, predictions.c.path, predictions.c.produced_at
    )
    for name, value in equal_to.items():
        stmt = stmt.where(predictions.c[name] == value)
    frame = _frame_from_rows(conn.execute(stmt).all(), PREDICTION_SCHEMA)
    return frame.with_columns(_as_utc(pl.col("produced_at")))


def online_answers(conn: Connection, *, model_version: str, record_ids: Sequence[str]) -> list[dict[str, Any]]:
    """Stored online answers of these records under one model version (for replays)."""
    parameters = {"model_version": model_version, "record_ids": list(record_ids)}
    return [dict(row._mapping) for row in conn.execute(_online_answers_statement(), parameters)]


@functools.cache
def _online_answers_statement() -> sa.Select[Any]:
    """Built once with its values bound: the service runs it for every adaptive batch."""
    p = predictions.c
    return sa.select(predictions).where(
        p.model_version == sa.bindparam("model_version", type_=p.model_version.type),
        p.path == ResultPath.ONLINE.value,
        p.record_id.in_(sa.bindparam("record_ids", expanding=True, type_=p.record_id.type)),
    )


def lineage_rows(
    ls: LoadedSpec, conn: Connection, record_id: str
) -> tuple[dict[str, Any] | None, list[dict[str, Any]]]:
    """The stored source record (or None) and every prediction row of one record."""
    rt = record_table(ls)
    source = conn.execute(sa.select(rt.table).where(rt.c[rt.id] == record_id)).mappings().first()
    results = conn.execute(
        sa.select(predictions).where(predictions.c.record_id == record_id).order_by(predictions.c.produced_at)
    ).mappings()
    return (dict(source) if source else None), [dict(row) for row in results]


# ------------------------------------------------------------------ path agreement
ANSWER_PAIR_SCHEMA: dict[str, pl.DataType] = {
    "record_id": pl.String(),
    "online_model_version": pl.String(),
    "online_answer_key": pl.String(),
    "online_score": pl.Float64(),
    "online_input_hash": pl.String(),
    "online_history_hash": pl.String(),
    "online_degraded": pl.Boolean(),
    "online_request_id": pl.String(),
    "online_produced_at": EVENT_TS_DTYPE,
    # Null when the record has no batch answer (yet): not scored, or rejected by batch.
    "batch_model_version": pl.String(),
    "batch_score": pl.Float64(),
    "batch_input_hash": pl.String(),
    "batch_history_hash": pl.String(),
    "batch_run_id": pl.String(),
    "batch_produced_at": EVENT_TS_DTYPE,
}


def answer_pairs(ls: LoadedSpec, conn: Connection, partition_date: date) -> pl.DataFrame:
    """Every online answer to a record stored in `partition_date`, beside the batch answer it
    is compared with (ANSWER_PAIR_SCHEMA): the batch answer under the same model version if there
    is one, else the record's newest batch answer. Several online answers to one record
    (retries with a changed body, other model versions) are several pairs."""
    rt = record_table(ls)
    t = rt.c
    online, batch, candidate = predictions.alias("online"), predictions.alias("batch"), predictions.alias("candidate")
    o, b, c = online.c, batch.c, candidate.c
    is_batch = sa.and_(c.record_id == o.record_id, c.path == ResultPath.BATCH.value)
    same_version = sa.select(c.model_version).where(is_batch, c.model_version == o.model_version).scalar_subquery()
    newest = (
        sa.select(c.model_version)
        .where(is_batch)
        .order_by(c.produced_at.desc(), c.model_version.desc())
        .limit(1)
        .scalar_subquery()
    )
    paired = sa.and_(
        b.record_id == o.record_id,
        b.path == ResultPath.BATCH.value,
        b.answer_key == "",
        b.model_version == sa.func.coalesce(same_version, newest),
    )
    stmt = (
        sa.select(
            o.record_id,
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
        .select_from(online.join(rt.table, t[rt.id] == o.record_id).outerjoin(batch, paired))
        .where(t.partition_date == partition_date, o.path == ResultPath.ONLINE.value)
        .order_by(o.record_id, o.produced_at, o.model_version, o.answer_key)
    )
    frame = _frame_from_rows(conn.execute(stmt).all(), ANSWER_PAIR_SCHEMA)
    return frame.with_columns(_as_utc(pl.col("online_produced_at")), _as_utc(pl.col("batch_produced_at")))
