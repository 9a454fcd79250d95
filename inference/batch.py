"""The batch path's work, free of Dagster: ingest a source day, score a stored partition.

Optimised for cost per item: the model is loaded by the caller once per run, a partition is
streamed in chunks through a pipeline of threads (read, features, forward passes, merge; memory
flat in partition size) and written in ONE transaction, so readers see the old partition or the
new one and a rerun never duplicates.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass, field
from datetime import date
from functools import partial
from typing import Any

import polars as pl
import torch
from sqlalchemy.engine import Connection, Engine

from inference.contract import FrameHistory, Predictor, StagedPredictor
from inference.pipeline import END, Aborted, Channel, End, Pipeline
from inference.records import RECEIVED_PREFIX, strip_text_fields, stripped_columns, validate
from inference.sources.common import MALFORMED_ROW, PROBLEM
from inference.spec import GenericReason, LoadedSpec
from inference.store import (
    BatchProducer,
    RejectStage,
    ResultPath,
    challenger_predictions,
    delete_batch_predictions,
    open_score_rejections,
    prediction_rows,
    predictions,
    prior_history,
    quarantine,
    record_table,
    resolve_rescored_rejections,
    resolve_superseded_rejections,
    resolve_unsent_ingest_rejections,
    stored_elsewhere,
    stream_partition_rows,
    upsert_challenger_predictions,
    upsert_predictions,
    upsert_records,
    utc_now,
    withdraw_unsent_records,
)


def ingest_rejections(ls: LoadedSpec) -> set[str]:
    """Reasons a row cannot be stored as a source record at all (no key, the key already taken in
    this batch, text PostgreSQL cannot hold, a numeric's text the number column cannot hold): such
    rows are quarantined at ingest, with the fields as received; everything else is stored as
    received and judged at scoring."""
    return {
        GenericReason.NUL_CHARACTER.value,
        GenericReason.MISSING_FIELD.value,
        GenericReason.DUPLICATE_ID.value,
        *(numeric.unparsable_code for numeric in ls.numerics),
    }


@dataclass(frozen=True)
class IngestReport:
    rows_received: int
    rows_stored: int
    rows_changed: int
    rejected_at_ingest: int
    # Stored rows whose outcome is known (0 or 1); None: the spec or the day has no label column.
    rows_labelled: int | None = None
    # Records stored from an earlier send of the day that this one no longer holds.
    rows_withdrawn: int = 0


def ingest_day(
    ls: LoadedSpec, engine: Engine, frame: pl.DataFrame, day: date, *, run_id: str | None = None
) -> IngestReport:
    """Store one source day idempotently; identical re-sends change nothing. `run_id`: the Dagster
    run ingesting it, named by the rows it quarantines (their lineage)."""
    # The text fields as received ride along, for the quarantine payload of a row refused here
    # (a source that strips them itself hands them over as received already).
    received = frame.with_columns(
        pl.col(name).alias(f"{RECEIVED_PREFIX}{name}")
        for name in stripped_columns(ls)
        if f"{RECEIVED_PREFIX}{name}" not in frame.columns
    )
    checked = validate(ls, strip_text_fields(ls, received))
    if PROBLEM in checked.columns:
        # A row its source could not read as written (see `sources.PROBLEM`) is quarantined as that,
        # with the why, whatever its values would say: they are not what the user wrote.
        checked = checked.with_columns(
            reject_reason=pl.when(pl.col(PROBLEM).is_not_null())
            .then(pl.lit(MALFORMED_ROW))
            .otherwise(pl.col("reject_reason")),
            reject_detail=pl.col(PROBLEM),
        )
    id_name = ls.id.name
    unstorable = (
        checked["reject_reason"].is_in([*ingest_rejections(ls), MALFORMED_ROW]).fill_null(False)
        | checked[id_name].is_null()
    )
    # Only refused rows need the received text: the stored rows, nearly all, are filtered without it.
    as_received = [name for name in checked.columns if name.startswith(RECEIVED_PREFIX)]
    storable, rejected = checked.drop(as_received).filter(~unstorable), checked.filter(unstorable)
    started = utc_now()
    with engine.begin() as conn:
        # The day's source is what the day holds: a stored record it no longer sends, or sends as
        # a row refused here, leaves the store (docs/data.md, "A re-sent day"). Asked before the
        # upsert, a day's first ingest finds nothing stored and reads no ids back.
        withdrawn = withdraw_unsent_records(
            ls,
            conn,
            partition_date=day,
            kept=storable[id_name],
            refused=rejected[id_name].drop_nulls(),
            run_id=run_id,
        )
        changed = upsert_records(ls, conn, storable, day)
        # An id another day holds is not this day's record: stored, it vanished (the same content,
        # a no-op) or moved the record out of its day (other content), without a word. The upsert
        # leaves such a row alone; asked after it, this also sees a day ingested at the same time
        # that took the id first (the upsert waited for it to commit). Corrections of a day land
        # in that day's source.
        elsewhere = stored_elsewhere(ls, conn, storable[id_name].to_list(), day)
        if elsewhere:
            taken = pl.col(id_name).is_in(list(elsewhere))
            stored_on = pl.col(id_name).replace_strict(
                {record_id: str(stored) for record_id, stored in elsewhere.items()}, default=None
            )
            rejected = pl.concat(
                [
                    rejected,
                    storable.filter(taken).with_columns(
                        reject_reason=pl.lit(GenericReason.DUPLICATE_ID.value),
                        reject_detail=pl.lit("already stored under partition ") + stored_on,
                    ),
                ],
                how="diagonal_relaxed",
            )
            storable = storable.filter(~taken)
        key = day.isoformat()
        quarantine(
            ls, conn, rejected, path=ResultPath.BATCH, stage=RejectStage.INGEST, partition_key=key, run_id=run_id
        )
        resolve_unsent_ingest_rejections(conn, partition_key=key, before=started)
    label = ls.label.name if ls.label is not None and ls.label.name in storable.columns else None
    labelled = None if label is None else storable.height - storable[label].null_count()
    return IngestReport(frame.height, storable.height, changed, rejected.height, labelled, withdrawn)


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
    # Seconds each pipeline stage spent working (not waiting on its neighbours): the largest is
    # the partition's bottleneck. read = stream + earlier days' history, features = history and
    # features, model = forward passes, write = staging + merge statements.
    stage_seconds: dict[str, float] = field(default_factory=dict)

    @property
    def rows_per_second(self) -> float:
        return self.rows_in / self.seconds if self.seconds else 0.0


# Chunks each queue between two stages may hold. Between the features stage and the merge at most
# 2 * QUEUE_DEPTH + model_workers chunks exist at once (a semaphore, so a slow worker cannot make
# the others' results pile up while the merge waits for its chunk): memory is flat in the
# partition size.
QUEUE_DEPTH = 2
# Model-stage threads; chosen by measurement on the 2-core machine (bench/findings.md). More cores:
# more workers (PredictionsConfig.model_workers), until the features stage is the bottleneck.
MODEL_WORKERS = 2
# Rows per forward pass on the batch path (TorchPredictor.forward_batch_size), chosen by measurement
# on the 2-core machine with MODEL_WORKERS single-threaded workers (bench/findings.md).
FORWARD_BATCH_SIZE = 128


def score_partition(
    ls: LoadedSpec,
    engine: Engine,
    predictor: Predictor,
    partition_date: date,
    *,
    producer: BatchProducer,
    history_length: int,
    chunk_rows: int = 8192,
    on_chunk: Callable[[ChunkProgress], None] | None = None,
    pipelined: bool = True,
    model_workers: int = MODEL_WORKERS,
    as_challenger: bool = False,
) -> PartitionReport:
    """Score every stored row of one day and write predictions + rejections in one transaction.

    `as_challenger`: a replay by the challenger, written to `challenger_predictions` alone; what it
    rejects is counted, not quarantined (the production run of the day quarantines the records).

    A pipeline, whatever the partition size: while chunk n goes through the model, chunk n+1 is
    read and featurised, and chunk n-1 is copied into staging and merged (by the calling thread,
    which owns the one write transaction). Stages are threads joined by bounded queues
    (QUEUE_DEPTH), so memory stays flat in the partition size; polars, numpy, torch and psycopg
    release the GIL in their heavy work. A failure in any stage stops all of them, rolls the
    transaction back (the old partition stays, whole) and is raised here once every stage
    thread has returned.

    A StagedPredictor (TorchPredictor) is split at `prepare` / `complete`, so features are built
    beside the forward passes; any other Predictor's `predict` runs whole in the model stage.
    `model_workers` threads run the model stage on different chunks at once, sharing the torch
    threads the caller set (torch.get_num_threads()) between them for the duration of the call:
    on 2 cores, 2 single-threaded workers waste less than 1 worker whose 2 OpenMP threads wait
    at every operator for a core that features, merge or PostgreSQL hold (bench/findings.md).
    `pipelined=False` runs the same steps one chunk after another in this thread (the reference
    the pipeline is measured and tested against).
    """
    scoring = _PartitionScoring(
        ls,
        engine,
        predictor,
        partition_date,
        producer=producer,
        history_length=history_length,
        chunk_rows=chunk_rows,
        on_chunk=on_chunk,
        as_challenger=as_challenger,
    )
    if not pipelined:
        _score_chunk_after_chunk(scoring)
    else:
        if model_workers < 1:
            raise ValueError(f"model_workers must be at least 1, not {model_workers}")
        _score_in_pipeline(scoring, model_workers)
    return scoring.finished()


_STAGES = ("read", "features", "model", "write")


class _PartitionScoring:
    """One call of score_partition: the steps every chunk goes through, and what they carry from
    one chunk to the next. No lock: each piece of state has one writer (`carry` the features
    stage, `open_rejections` and the report the caller's thread), and `score`, which several
    model workers run at once, changes nothing. `pipeline` times each step under its stage's name."""

    def __init__(
        self,
        ls: LoadedSpec,
        engine: Engine,
        predictor: Predictor,
        partition_date: date,
        *,
        producer: BatchProducer,
        history_length: int,
        chunk_rows: int,
        on_chunk: Callable[[ChunkProgress], None] | None,
        as_challenger: bool,
    ) -> None:
        self.spec = ls
        self.records = record_table(ls)
        self.engine = engine
        self.predictor = predictor
        self.staged = predictor if isinstance(predictor, StagedPredictor) else None
        self.partition_date = partition_date
        self.producer = producer
        self.history_length = history_length
        self.chunk_rows = chunk_rows
        self.on_chunk = on_chunk
        self.as_challenger = as_challenger
        self.report = PartitionReport()
        self.pipeline = Pipeline(QUEUE_DEPTH)
        self.started = time.perf_counter()
        # The latest rows of the entity the previous chunk ended with: part of the next one's history.
        self.carry = pl.DataFrame(schema=self.records.history_schema)
        # Read once, in the write transaction, so each chunk resolves only what is open instead of
        # running an UPDATE over every id it scored (a partition rejects a few percent of its rows).
        self.open_rejections: set[str] | None = None
        # Records this run rejects: their earlier batch answers are deleted once, at the close.
        self.rejected_ids: list[str] = []

    def chunks(self) -> Generator[tuple[pl.DataFrame, pl.DataFrame]]:
        """The partition's stored rows in chunks, each with its entities' rows from earlier days."""
        chunks = stream_partition_rows(self.spec, self.engine, self.partition_date, self.chunk_rows)
        try:
            while True:
                began = time.perf_counter()
                chunk = next(chunks, None)
                if chunk is None:
                    return
                before = self._earlier_days(chunk)
                self.pipeline.timed("read", began)
                yield chunk, before
        finally:
            # Closing the generator now (not at garbage collection) releases its cursor's connection.
            close = getattr(chunks, "close", None)
            if close is not None:
                close()

    def _earlier_days(self, chunk: pl.DataFrame) -> pl.DataFrame:
        entity = self.spec.history_entity(self.history_length)
        if entity is None:
            return pl.DataFrame(schema=self.records.history_schema)
        earliest = chunk.group_by(entity).agg(pl.col("event_ts").min())
        with self.engine.connect() as conn:
            return prior_history(self.spec, conn, earliest, self.partition_date, self.history_length)

    def featurise(self, chunk: pl.DataFrame, before: pl.DataFrame) -> Any:
        """The chunk validated, with its history, ready for `score` (a StagedPredictor's prepared batch)."""
        # The chunk is validated once, for both its roles (the rows scored and part of their own
        # history), and keeps the input_hash stored with it: validating twice and hashing again
        # were 40% of this stage (bench/findings.md).
        ls, records = self.spec, self.records
        checked = validate(ls, chunk.select(records.raw_columns)).with_columns(chunk["input_hash"])
        earlier = pl.concat([before, self.carry])
        history = FrameHistory(
            ls,
            pl.concat(
                [
                    validate(ls, earlier.select(records.raw_columns)).with_columns(earlier["input_hash"]),
                    checked,
                ]
            ),
        )
        work = self.staged.prepare(checked, history) if self.staged is not None else (checked, history)
        entity = ls.history_entity(self.history_length)
        if entity is not None:
            # The last entity may go on in the next chunk: its latest rows are that chunk's history.
            self.carry = (
                history.valid_rows.select(*records.history_schema)
                .filter(pl.col(entity) == chunk[entity][-1])
                .tail(self.history_length)
            )
        return work

    def score(self, work: Any) -> pl.DataFrame:
        return self.staged.complete(work) if self.staged is not None else self.predictor.predict(*work)

    def write(self, conn: Connection, chunk: pl.DataFrame, results: pl.DataFrame) -> None:
        """One scored chunk into the partition's open transaction `conn`; progress to `on_chunk`."""
        began = time.perf_counter()
        if self.open_rejections is None:
            self.open_rejections = (
                set() if self.as_challenger else open_score_rejections(conn, partition_key=self.producer.partition_key)
            )
        rejected_ids = _write_chunk(
            self.spec,
            conn,
            chunk,
            results,
            self.predictor,
            self.producer,
            self.report,
            self.open_rejections,
            as_challenger=self.as_challenger,
        )
        self.rejected_ids.extend(rejected_ids)
        self.pipeline.timed("write", began)
        if self.on_chunk is not None:
            elapsed = time.perf_counter() - self.started
            report = self.report
            self.on_chunk(ChunkProgress(report.chunks, report.rows_in, report.rows_in / elapsed if elapsed else 0.0))

    def close_partition(self, conn: Connection) -> None:
        """After the last chunk, in the same transaction: batch answers of records now rejected are
        deleted, and rejections that no longer hold are resolved."""
        # Once per partition, not per chunk: with statistics older than the run (a new table, a
        # cleared partition) PostgreSQL plans the delete as a scan of the rows written so far, so
        # per chunk the write stage grew with the square of the partition (bench/findings.md).
        self.pipeline.timing(
            "write",
            delete_batch_predictions,
            conn,
            partition_key=self.producer.partition_key,
            model_version=self.predictor.model_version,
            record_ids=self.rejected_ids,
            table=challenger_predictions if self.as_challenger else predictions,
        )
        if not self.as_challenger:
            self.pipeline.timing(
                "write", resolve_superseded_rejections, self.spec, conn, partition_key=self.producer.partition_key
            )

    def finished(self) -> PartitionReport:
        report = self.report
        report.seconds = time.perf_counter() - self.started
        report.stage_seconds = {stage: round(self.pipeline.busy.get(stage, 0.0), 3) for stage in _STAGES}
        return report


def _score_chunk_after_chunk(scoring: _PartitionScoring) -> None:
    """The reference: every step of a chunk in this thread before the next chunk is read."""
    pipeline = scoring.pipeline
    with scoring.engine.begin() as conn:
        for chunk, before in scoring.chunks():
            work = pipeline.timing("features", scoring.featurise, chunk, before)
            results = pipeline.timing("model", scoring.score, work)
            scoring.write(conn, chunk, results)
        scoring.close_partition(conn)


def _score_in_pipeline(scoring: _PartitionScoring, model_workers: int) -> None:
    """Read, features and `model_workers` model stages in threads; the write in this one, which
    owns the transaction. Raises the first stage's failure once every stage has returned."""
    pipeline = scoring.pipeline
    raw_chunks, prepared_chunks, scored_chunks = pipeline.channel(), pipeline.channel(), pipeline.channel()
    # Released once a chunk is merged: between the features stage and the merge at most this many
    # chunks exist, however slow one model worker is.
    in_flight = threading.Semaphore(2 * QUEUE_DEPTH + model_workers)
    threads_before = torch.get_num_threads()
    # Set here, before the workers start: each picks the count up at its first torch operation.
    torch.set_num_threads(max(1, threads_before // model_workers))
    pipeline.start("read", partial(_read_stage, scoring, raw_chunks))
    pipeline.start("features", partial(_features_stage, scoring, raw_chunks, prepared_chunks, in_flight))
    for worker in range(model_workers):
        pipeline.start(f"model-{worker}", partial(_model_stage, scoring, prepared_chunks, scored_chunks))
    try:
        with scoring.engine.begin() as conn:
            for chunk, results in _in_stream_order(pipeline, scored_chunks, model_workers):
                scoring.write(conn, chunk, results)
                in_flight.release()
            scoring.close_partition(conn)
    except Aborted:
        # A stage failed and the transaction has rolled back: raise that stage's error, not ours.
        pipeline.close()
        assert pipeline.failure is not None
        raise pipeline.failure from None
    finally:
        pipeline.close()
        torch.set_num_threads(threads_before)


def _read_stage(scoring: _PartitionScoring, raw_chunks: Channel) -> None:
    items = scoring.chunks()
    try:
        for item in items:
            scoring.pipeline.put(raw_chunks, item)
    finally:
        items.close()
    scoring.pipeline.put(raw_chunks, END)


def _features_stage(
    scoring: _PartitionScoring, raw_chunks: Channel, prepared_chunks: Channel, in_flight: threading.Semaphore
) -> None:
    pipeline = scoring.pipeline
    for number, (chunk, before) in enumerate(pipeline.items(raw_chunks)):
        work = pipeline.timing("features", scoring.featurise, chunk, before)
        pipeline.acquire(in_flight)  # released once the chunk is merged
        pipeline.put(prepared_chunks, (number, chunk, work))
    pipeline.put(prepared_chunks, END)


def _model_stage(scoring: _PartitionScoring, prepared_chunks: Channel, scored_chunks: Channel) -> None:
    pipeline = scoring.pipeline
    for number, chunk, work in pipeline.items(prepared_chunks):
        pipeline.put(scored_chunks, (number, chunk, pipeline.timing("model", scoring.score, work)))
    # Left on the queue for the other model workers, each of which ends its own stream.
    pipeline.put(prepared_chunks, END)
    pipeline.put(scored_chunks, END)


def _in_stream_order(
    pipeline: Pipeline, scored_chunks: Channel, model_workers: int
) -> Iterator[tuple[pl.DataFrame, pl.DataFrame]]:
    """Scored chunks in stream order, whichever worker finished first: every run writes in one
    key order, so two runs racing on a partition wait for each other instead of deadlocking."""
    waiting: dict[int, tuple[pl.DataFrame, pl.DataFrame]] = {}
    ended, following = 0, 0
    while ended < model_workers:
        item = pipeline.get(scored_chunks)
        if isinstance(item, End):
            ended += 1
            continue
        number, chunk, results = item
        waiting[number] = (chunk, results)
        while following in waiting:
            yield waiting.pop(following)
            following += 1


def _write_chunk(
    ls: LoadedSpec,
    write: Connection,
    chunk: pl.DataFrame,
    results: pl.DataFrame,
    predictor: Predictor,
    producer: BatchProducer,
    report: PartitionReport,
    open_rejections: set[str],
    *,
    as_challenger: bool,
) -> list[str]:
    """One chunk's results into the partition's open transaction, and into the report; returns
    the ids of the records it rejected. `open_rejections`: the partition's records with an open
    scoring rejection, less those resolved."""
    scored = results.filter(pl.col("reject_reason").is_null())
    rejected = (
        chunk.select(record_table(ls).raw_columns)
        .with_columns(results["reject_reason"], results["reject_detail"])
        .filter(pl.col("reject_reason").is_not_null())
    )
    rows = _prediction_rows(scored, predictor, producer)
    if as_challenger:
        report.rows_written += upsert_challenger_predictions(write, rows)
    else:
        report.rows_written += upsert_predictions(write, rows)
        quarantine(
            ls,
            write,
            rejected,
            path=ResultPath.BATCH,
            stage=RejectStage.SCORE,
            partition_key=producer.partition_key,
            run_id=producer.run_id,
        )
        # A record another model version (or the record's earlier contents) was refused for is
        # scored now: its rejection is over, or it counts as scored and rejected at once.
        rescored = [rid for rid in scored["record_id"].to_list() if rid in open_rejections]
        if rescored:
            resolve_rescored_rejections(write, partition_key=producer.partition_key, record_ids=rescored)
            open_rejections.difference_update(rescored)
    report.rows_in += chunk.height
    report.scored += scored.height
    report.rejected += rejected.height
    report.rejected_by_reason.update(rejected["reject_reason"].to_list())
    unseen = scored["unseen_fields"].drop_nulls()
    report.scored_with_unseen += unseen.len()
    report.unseen_by_field.update(unseen.str.split(",").explode().to_list())
    report.chunks += 1
    return list(rejected[ls.id.name].drop_nulls().to_list())


def _prediction_rows(scored: pl.DataFrame, predictor: Predictor, producer: BatchProducer) -> pl.DataFrame:
    return prediction_rows(scored, producer=producer, model_version=predictor.model_version, produced_at=utc_now())
