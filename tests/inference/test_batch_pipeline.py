"""score_partition as a pipeline: the same rows as one chunk after another, and a failure in any
stage leaves the partition as it was, with every stage thread gone. SQLite and PostgreSQL."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from datetime import date
from typing import Any

import polars as pl
import pytest
import sqlalchemy as sa
from sqlalchemy.engine import Engine

from inference.batch import (
    QUEUE_DEPTH,
    ChunkProgress,
    PartitionReport,
    ingest_day,
)
from inference.contract import HistorySource, PreparedBatch, TorchPredictor
from inference.demo import day_range
from inference.store import challenger_predictions, predictions
from tandem_specs.transactions.demo import DemoConfig, generate_day
from tests.inference.support import (
    DAY,
    ingest_days,
    predictions_of,
    rejections,
    score_day,
    untrained_model,
    untrained_predictor,
)
from tests.reference import REFERENCE

pytestmark = pytest.mark.usefixtures("torch_single_thread")

CONFIG = DemoConfig(seed=11, rows_per_day=700, poison_rate=0.05)
DAYS = day_range(DAY, 2)
# Small chunks: ~7 per partition, so every stage holds a different chunk at once and accounts
# cross chunk boundaries (the history carried from one chunk to the next is exercised).
CHUNK_ROWS = 97
FORWARD_BATCH_SIZE = 64  # below CHUNK_ROWS: a chunk takes more than one forward pass
FAILING_CHUNK = 3
# What differs between two runs by design: who wrote the row, when, under which version tag.
PER_RUN = ["model_version", "run_id", "produced_at"]


def predictor(model_version: str = "risk:untrained") -> TorchPredictor:
    return untrained_predictor(model_version, forward_batch_size=FORWARD_BATCH_SIZE)


def score(engine: Engine, scorer: Any, *, run_id: str, chunk_rows: int = CHUNK_ROWS, **options: Any) -> PartitionReport:
    return score_day(engine, DAYS[-1], scorer, run_id=run_id, chunk_rows=chunk_rows, **options)


def stage_threads() -> list[threading.Thread]:
    return [thread for thread in threading.enumerate() if thread.name.startswith("tandem-batch-")]


def report_facts(report: PartitionReport) -> dict[str, Any]:
    return {
        "rows_in": report.rows_in,
        "scored": report.scored,
        "rejected": report.rejected,
        "rows_written": report.rows_written,
        "chunks": report.chunks,
        "rejected_by_reason": report.rejected_by_reason,
        "unseen_by_field": report.unseen_by_field,
        "scored_with_unseen": report.scored_with_unseen,
    }


@pytest.mark.parametrize("model_workers", [1, 2])
def test_the_pipeline_writes_what_one_chunk_after_another_writes_row_for_row(
    engine: Engine, model_workers: int
) -> None:
    ingest_days(engine, CONFIG, DAYS)
    sequential = score(engine, predictor("sequential"), run_id="sequential", pipelined=False)
    after_sequential = rejections(engine)
    pipelined = score(engine, predictor("pipelined"), run_id="pipelined", pipelined=True, model_workers=model_workers)

    assert sequential.chunks == -(-sequential.rows_in // CHUNK_ROWS) >= 5
    assert report_facts(pipelined) == report_facts(sequential)
    expected = predictions_of(engine, model_version="sequential").drop(PER_RUN)
    actual = predictions_of(engine, model_version="pipelined").drop(PER_RUN)
    assert actual.height == sequential.scored > 0
    # Every column, scores bit for bit: the chunks and the forward batches are the same ones.
    assert actual.equals(expected)
    # The same records quarantined for the same reasons; the rerun only saw them once more.
    again = rejections(engine)
    assert again.drop("seen_count", "last_seen").equals(after_sequential.drop("seen_count", "last_seen"))
    rescored = (after_sequential["stage"] == "score").to_numpy()
    assert rescored.any()
    assert (again["seen_count"] - after_sequential["seen_count"]).to_list() == rescored.astype(int).tolist()
    assert set(pipelined.stage_seconds) == {"read", "features", "model", "write"}
    assert not stage_threads()


class ChunkFailure(RuntimeError):
    pass


@dataclass
class FailsOnChunk(TorchPredictor):
    """The real predictor, except that one stage raises on chunk FAILING_CHUNK, once the chunks
    before it are written into the open transaction (so there is something to roll back)."""

    failing_stage: str = "model"
    earlier_written: threading.Event = field(default_factory=threading.Event)
    calls: dict[str, int] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def _count(self, stage: str) -> None:
        with self.lock:  # two model workers call at once
            self.calls[stage] = calls = self.calls.get(stage, 0) + 1
        if stage == self.failing_stage and calls == FAILING_CHUNK:
            assert self.earlier_written.wait(30), "the chunks before the failing one were never written"
            raise ChunkFailure(f"{stage} failed on chunk {FAILING_CHUNK}")

    def prepare(self, frame: pl.DataFrame, history: HistorySource) -> PreparedBatch:
        self._count("features")
        return super().prepare(frame, history)

    def complete(self, prepared: PreparedBatch) -> pl.DataFrame:
        self._count("model")
        return super().complete(prepared)


@dataclass
class UnstagedFailsOnChunk:
    """A Predictor with `predict` only (no prepare/complete): its calls run whole in the model stage."""

    failing: FailsOnChunk

    @property
    def model_version(self) -> str:
        return self.failing.model_version

    def predict(self, frame: pl.DataFrame, history: HistorySource) -> pl.DataFrame:
        self.failing._count("model")
        return TorchPredictor.predict(predictor(self.model_version), frame, history)


@pytest.mark.parametrize(
    ("failing_stage", "model_workers", "staged"),
    [
        pytest.param("features", 1, True, id="features"),
        pytest.param("model", 1, True, id="model"),
        pytest.param("model", 2, True, id="model-two-workers"),
        pytest.param("model", 1, False, id="model-unstaged-predictor"),
        pytest.param("write", 1, True, id="write"),
    ],
)
def test_a_stage_failing_on_chunk_three_leaves_the_old_partition_and_no_thread(
    engine: Engine, failing_stage: str, model_workers: int, staged: bool
) -> None:
    ingest_days(engine, CONFIG, DAYS)
    version = "risk:untrained"
    score(engine, predictor(version), run_id="old-run")
    old_predictions, old_rejections = predictions_of(engine), rejections(engine)
    assert old_predictions.height > 0 and old_rejections.height > 0

    failing = FailsOnChunk(
        model=untrained_model(),
        model_version=version,
        spec=REFERENCE,
        forward_batch_size=FORWARD_BATCH_SIZE,
        failing_stage=failing_stage,
    )
    # The failed run's writes differ from the old partition (rejections seen once more, their
    # run_id), so a partial commit would show.
    written: list[int] = []

    def on_chunk(progress: ChunkProgress) -> None:
        written.append(progress.chunk)
        if progress.chunk == FAILING_CHUNK - 1:
            failing.earlier_written.set()
        if failing_stage == "write" and progress.chunk == FAILING_CHUNK:
            raise ChunkFailure(f"write failed on chunk {FAILING_CHUNK}")

    outcome: dict[str, BaseException] = {}

    def run() -> None:
        try:
            score(
                engine,
                failing if staged else UnstagedFailsOnChunk(failing),
                run_id="failed-run",
                on_chunk=on_chunk,
                model_workers=model_workers,
            )
        except BaseException as error:  # noqa: BLE001 - inspected below
            outcome["error"] = error

    caller = threading.Thread(target=run)
    caller.start()
    caller.join(60)
    assert not caller.is_alive(), "score_partition hung after a stage failed"

    error = outcome.get("error")
    assert isinstance(error, ChunkFailure), error
    assert str(error) == f"{failing_stage} failed on chunk {FAILING_CHUNK}"
    assert written[: FAILING_CHUNK - 1] == [1, 2], "chunks 1 and 2 went into the transaction first"
    # Rolled back whole: the old partition, row for row (run ids, rejection counts included).
    assert predictions_of(engine).equals(old_predictions)
    assert rejections(engine).equals(old_rejections)
    assert not stage_threads(), stage_threads()
    assert engine.pool.checkedout() == 0, "a stage kept a database connection"

    # And nothing is left over that a rerun would trip on.
    rerun = score(engine, predictor(version), run_id="rerun", model_workers=model_workers)
    assert rerun.rows_written == 0
    assert predictions_of(engine).drop(PER_RUN).equals(old_predictions.drop(PER_RUN))


@dataclass
class StallsFirstForward(TorchPredictor):
    """Counts chunks featurised but not yet merged. The first forward call stalls its worker until
    the other one has filled the pipeline up to MOST_IN_FLIGHT, then for RUNAWAY_S more unless a
    chunk past the bound ends the wait at once. The pipeline has no clock to inject and does not
    show a stage blocked on its permit, so that one grace period is what "the others stopped" costs."""

    prepared: int = 0
    merged: int = 0
    most_in_flight: int = 0
    stalled: bool = False
    changed: threading.Condition = field(default_factory=threading.Condition)

    def prepare(self, frame: pl.DataFrame, history: HistorySource) -> PreparedBatch:
        with self.changed:
            self.prepared += 1
            self.most_in_flight = max(self.most_in_flight, self.prepared - self.merged)
            self.changed.notify_all()
        return super().prepare(frame, history)

    def complete(self, prepared: PreparedBatch) -> pl.DataFrame:
        with self.changed:
            first, self.stalled = not self.stalled, True
            if first:
                full = self.changed.wait_for(lambda: self.most_in_flight >= MOST_IN_FLIGHT, timeout=60)
                assert full, f"the other worker filled only {self.most_in_flight} of {MOST_IN_FLIGHT} places"
                self.changed.wait_for(lambda: self.most_in_flight > MOST_IN_FLIGHT, timeout=RUNAWAY_S)
        return super().complete(prepared)


# With two model workers: chunks featurised and not yet merged are the in-flight permits, plus the
# one the features stage holds while it waits for a permit.
MOST_IN_FLIGHT = 2 * QUEUE_DEPTH + 2 + 1
# Once the pipeline is full: long enough for an unbounded features stage (a few ms a chunk here) to
# run well past the bound.
RUNAWAY_S = 0.3


def test_a_stalled_worker_does_not_let_the_others_results_pile_up(engine: Engine) -> None:
    ingest_days(engine, CONFIG, DAYS)
    slow = StallsFirstForward(
        model=untrained_model(), model_version="slow", spec=REFERENCE, forward_batch_size=FORWARD_BATCH_SIZE
    )

    def merged(progress: ChunkProgress) -> None:
        with slow.changed:
            slow.merged = progress.chunk

    report = score(engine, slow, run_id="slow", chunk_rows=25, model_workers=2, on_chunk=merged)
    assert report.chunks >= 20
    # Without the bound the free worker would score every chunk while the stalled one waits.
    assert slow.most_in_flight == MOST_IN_FLIGHT, slow.most_in_flight


def test_an_empty_partition_commits_nothing_and_stops_every_stage(engine: Engine) -> None:
    ingest_days(engine, CONFIG, DAYS)
    report = score_day(engine, date(2030, 1, 1), predictor(), run_id="empty")
    assert (report.rows_in, report.chunks) == (0, 0)
    assert not stage_threads()


@pytest.mark.parametrize("as_challenger", [False, True], ids=["production", "challenger"])
def test_a_rerun_drops_the_answers_of_records_a_correction_made_invalid(engine: Engine, as_challenger: bool) -> None:
    ingest_days(engine, CONFIG, DAYS)
    table = challenger_predictions if as_challenger else predictions
    score(engine, predictor("v1"), run_id="first", as_challenger=as_challenger)
    score(engine, predictor("v2"), run_id="other-version", as_challenger=as_challenger)
    first = answers_of(engine, table, "v1")
    # The first, a middle and the last record: three different chunks of the rerun.
    invalid = [first[0], first[len(first) // 2], first[-1]]
    source = generate_day(DAYS[-1], CONFIG)
    corrected = source.with_columns(
        pl.when(pl.col("transaction_id").is_in(invalid)).then(-1.0).otherwise(pl.col("amount")).alias("amount")
    )
    ingest_day(REFERENCE, engine, corrected, DAYS[-1])

    report = score(engine, predictor("v1"), run_id="rerun", as_challenger=as_challenger)

    assert answers_of(engine, table, "v1") == sorted(set(first) - set(invalid))
    assert set(invalid) <= set(answers_of(engine, table, "v2")), "another version's answers are its own"
    assert report.rejected_by_reason["amount_negative"] >= len(invalid)


def answers_of(engine: Engine, table: sa.Table, model_version: str) -> list[str]:
    """The record ids `model_version` has a batch answer for in `table`, in order."""
    c = table.c
    with engine.connect() as conn:
        query = sa.select(c.record_id).where(c.model_version == model_version, c.path == "batch")
        return list(conn.execute(query.order_by(c.record_id)).scalars())
