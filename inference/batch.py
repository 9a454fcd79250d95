"""The batch path's work, free of Dagster: ingest a source day, score a stored partition.

Optimised for cost per item: the model is loaded by the caller once per run, a partition is
streamed in large chunks (memory flat in partition size), scored in large tensors, and written in
ONE transaction, so readers see the old partition or the new one and a rerun never duplicates.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import date

import polars as pl
from sqlalchemy.engine import Engine

from inference.contract import FrameHistory, Predictor
from inference.records import EVENT_TS_DTYPE, RAW_COLUMNS, RejectReason, validate
from inference.store import (
    HISTORY_SCHEMA,
    RejectStage,
    ResultPath,
    delete_batch_predictions,
    prior_history,
    quarantine,
    resolve_superseded_rejections,
    stream_partition_rows,
    upsert_predictions,
    upsert_transactions,
    utc_now,
)

# Rows that cannot be stored as a source record at all (no key, or the key already taken in this
# batch) are quarantined at ingest; everything else is stored as received and judged at scoring.
INGEST_REJECTIONS = {RejectReason.MISSING_FIELD.value, RejectReason.DUPLICATE_ID.value}


@dataclass(frozen=True)
class IngestReport:
    rows_received: int
    rows_stored: int
    rows_changed: int
    rejected_at_ingest: int


def ingest_day(engine: Engine, frame: pl.DataFrame, day: date) -> IngestReport:
    """Store one source day idempotently; identical re-sends change nothing."""
    checked = validate(frame)
    unstorable = (
        checked["reject_reason"].is_in(list(INGEST_REJECTIONS)).fill_null(False) | checked["transaction_id"].is_null()
    )
    storable, rejected = checked.filter(~unstorable), checked.filter(unstorable)
    with engine.begin() as conn:
        changed = upsert_transactions(conn, storable, day)
        quarantine(conn, rejected, path=ResultPath.BATCH, stage=RejectStage.INGEST, partition_key=day.isoformat())
    return IngestReport(frame.height, storable.height, changed, rejected.height)


@dataclass(frozen=True)
class BatchProducer:
    """Lineage of a batch write: which run wrote it, for which partition, from which code."""

    run_id: str
    partition_key: str
    code_version: str


@dataclass(frozen=True)
class ChunkProgress:
    chunk: int
    rows_done: int
    rows_per_second: float


@dataclass
class PartitionReport:
    rows_in: int = 0
    scored: int = 0
    rejected: int = 0
    rows_written: int = 0
    chunks: int = 0
    seconds: float = 0.0
    rejected_by_reason: Counter[str] = field(default_factory=Counter)
    # Scored rows per field outside the training vocabulary, and rows with any such field.
    unseen_by_field: Counter[str] = field(default_factory=Counter)
    scored_with_unseen: int = 0

    @property
    def rows_per_second(self) -> float:
        return self.rows_in / self.seconds if self.seconds else 0.0


def score_partition(
    engine: Engine,
    predictor: Predictor,
    partition_date: date,
    *,
    producer: BatchProducer,
    history_length: int,
    chunk_rows: int = 8192,
    on_chunk: Callable[[ChunkProgress], None] | None = None,
) -> PartitionReport:
    """Score every stored row of one day and write predictions + rejections in one transaction."""
    report = PartitionReport()
    started = time.perf_counter()
    carry = pl.DataFrame(schema=HISTORY_SCHEMA)
    with engine.begin() as write:
        for chunk in stream_partition_rows(engine, partition_date, chunk_rows):
            accounts = chunk["account_id"].drop_nulls().unique().to_list()
            with engine.connect() as read:
                before = prior_history(read, accounts, partition_date, history_length)
            history = FrameHistory(pl.concat([before, carry, chunk.select(*HISTORY_SCHEMA)]))
            results = predictor.predict(chunk.select(RAW_COLUMNS), history)
            scored = results.filter(pl.col("reject_reason").is_null())
            rejected = (
                chunk.select(RAW_COLUMNS)
                .with_columns(results["reject_reason"], results["reject_detail"])
                .filter(pl.col("reject_reason").is_not_null())
            )

            report.rows_written += upsert_predictions(write, _prediction_rows(scored, predictor, producer))
            quarantine(
                write,
                rejected,
                path=ResultPath.BATCH,
                stage=RejectStage.SCORE,
                partition_key=producer.partition_key,
                run_id=producer.run_id,
            )
            delete_batch_predictions(
                write,
                partition_key=producer.partition_key,
                model_version=predictor.model_version,
                transaction_ids=rejected["transaction_id"].drop_nulls().to_list(),
            )
            carry = (
                history.valid_rows.select(*HISTORY_SCHEMA)
                .filter(pl.col("account_id") == chunk["account_id"][-1])
                .tail(history_length)
            )

            report.rows_in += chunk.height
            report.scored += scored.height
            report.rejected += rejected.height
            report.rejected_by_reason.update(rejected["reject_reason"].to_list())
            unseen = scored["unseen_fields"].drop_nulls()
            report.scored_with_unseen += unseen.len()
            report.unseen_by_field.update(unseen.str.split(",").explode().to_list())
            report.chunks += 1
            if on_chunk is not None:
                elapsed = time.perf_counter() - started
                on_chunk(ChunkProgress(report.chunks, report.rows_in, report.rows_in / elapsed if elapsed else 0.0))
        resolve_superseded_rejections(write, partition_key=producer.partition_key)
    report.seconds = time.perf_counter() - started
    return report


def _prediction_rows(scored: pl.DataFrame, predictor: Predictor, producer: BatchProducer) -> pl.DataFrame:
    return scored.select(
        "transaction_id",
        pl.lit(predictor.model_version).alias("model_version"),
        "score",
        pl.lit(ResultPath.BATCH.value).alias("path"),
        pl.lit(producer.run_id).alias("run_id"),
        pl.lit(producer.partition_key).alias("partition_key"),
        pl.lit(None, dtype=pl.String).alias("request_id"),
        pl.lit(None, dtype=pl.String).alias("batch_id"),
        pl.lit(producer.code_version).alias("code_version"),
        "input_hash",
        "history_hash",
        "unseen_fields",
        pl.lit(None, dtype=pl.String).alias("idempotency_key"),
        pl.lit(utc_now(), dtype=EVENT_TS_DTYPE).alias("produced_at"),
        pl.lit(None, dtype=pl.Float64).alias("latency_ms"),
    )
