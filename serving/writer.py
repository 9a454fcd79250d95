"""Result persistence off the event loop: one upsert per adaptive batch, an outbox when the
database is down, and a drain of that outbox once it is back.

One thread owns all writes so batches land in order and the scoring thread never waits on them.
"""

from __future__ import annotations

import logging
import queue
import threading
from dataclasses import dataclass
from typing import Any

import polars as pl
import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.exc import SQLAlchemyError

from inference.records import raw_frame
from inference.store import RejectStage, ResultPath, predictions, quarantine, upsert_predictions
from serving.breaker import CircuitBreaker
from serving.metrics import ServingMetrics
from serving.outbox import Outbox
from serving.scoring import DEGRADED_HASH_SUFFIX, prediction_frame

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Rows:
    rows: list[dict[str, Any]]


@dataclass(frozen=True)
class _Rejections:
    rows: list[dict[str, Any]]  # RAW columns + reject_reason + reject_detail + request_id


_STOP = object()


def write_prediction_rows(conn: Connection, rows: list[dict[str, Any]]) -> int:
    """Upsert rows; a degraded (history-less) row never replaces a row already stored."""
    degraded = [row for row in rows if row["input_hash"].endswith(DEGRADED_HASH_SUFFIX)]
    if degraded:
        p = predictions.c
        pairs = {(row["transaction_id"], row["model_version"]) for row in degraded}
        existing = {
            (found.transaction_id, found.model_version)
            for found in conn.execute(
                sa.select(p.transaction_id, p.model_version).where(p.transaction_id.in_([pair[0] for pair in pairs]))
            )
        }
        rows = [
            row
            for row in rows
            if not (
                row["input_hash"].endswith(DEGRADED_HASH_SUFFIX)
                and (row["transaction_id"], row["model_version"]) in existing
            )
        ]
    return upsert_predictions(conn, prediction_frame(rows)) if rows else 0


class ResultWriter:
    def __init__(
        self,
        engine: Engine,
        breaker: CircuitBreaker,
        outbox: Outbox,
        metrics: ServingMetrics,
        *,
        drain_interval_s: float,
        drain_chunk: int,
    ) -> None:
        self.engine = engine
        self.breaker = breaker
        self.outbox = outbox
        self.metrics = metrics
        self.drain_interval_s = drain_interval_s
        self.drain_chunk = drain_chunk
        self._jobs: queue.Queue[object] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="tandem-result-writer", daemon=True)
        self._outbox_depth = outbox.depth()
        metrics.outbox_depth.set(self._outbox_depth)

    @property
    def outbox_depth(self) -> int:
        return self._outbox_depth

    def start(self) -> None:
        self._thread.start()

    def submit_rows(self, rows: list[dict[str, Any]]) -> None:
        if rows:
            self._jobs.put(_Rows(rows))

    def submit_rejections(self, rows: list[dict[str, Any]]) -> None:
        if rows:
            self._jobs.put(_Rejections(rows))

    def flush(self) -> None:
        """Block until every submitted job has been written or spilled to the outbox."""
        self._jobs.join()

    def close(self) -> None:
        self._jobs.put(_STOP)
        self._thread.join(timeout=30)

    def _run(self) -> None:
        while True:
            try:
                job = self._jobs.get(timeout=self.drain_interval_s)
            except queue.Empty:
                self.drain()
                continue
            try:
                if job is _STOP:
                    return
                if isinstance(job, _Rows):
                    self._write(job.rows)
                elif isinstance(job, _Rejections):
                    self._quarantine(job.rows)
                if self._outbox_depth:
                    self.drain()
            except Exception:  # a writer that dies silently would lose every later row
                logger.exception("result writer job failed")
            finally:
                self._jobs.task_done()

    def _write(self, rows: list[dict[str, Any]]) -> None:
        if self.breaker.allow():
            try:
                with self.engine.begin() as conn:
                    write_prediction_rows(conn, rows)
            except SQLAlchemyError as error:
                self.breaker.record_failure()
                logger.warning("prediction write failed; %d rows to the outbox: %s", len(rows), error)
            else:
                self.breaker.record_success()
                return
        self.outbox.append(rows)
        self._set_depth(self._outbox_depth + len(rows))

    def drain(self) -> int:
        if not self._outbox_depth or not self.breaker.allow():
            self.metrics.breaker_state.set(int(self.breaker.state))
            return 0

        def write(rows: list[dict[str, Any]]) -> None:
            with self.engine.begin() as conn:
                write_prediction_rows(conn, rows)

        drained = 0
        try:
            drained = self.outbox.drain(write, self.drain_chunk)
        except SQLAlchemyError as error:
            self.breaker.record_failure()
            logger.warning("outbox drain stopped: %s", error)
        else:
            self.breaker.record_success()
        self._set_depth(self.outbox.depth())
        self.metrics.breaker_state.set(int(self.breaker.state))
        return drained

    def _quarantine(self, rows: list[dict[str, Any]]) -> None:
        # Best effort: a quarantine row lost to an outage costs a diagnostic, never an answer.
        if not self.breaker.allow():
            return
        frame = raw_frame(rows).with_columns(
            reject_reason=pl.Series([row["reject_reason"] for row in rows], dtype=pl.String),
            reject_detail=pl.Series([row.get("reject_detail") for row in rows], dtype=pl.String),
        )
        by_request: dict[str | None, list[int]] = {}
        for index, row in enumerate(rows):
            by_request.setdefault(row.get("request_id"), []).append(index)
        try:
            with self.engine.begin() as conn:
                for request_id, positions in by_request.items():
                    quarantine(
                        conn,
                        frame[positions],
                        path=ResultPath.ONLINE,
                        stage=RejectStage.SCORE,
                        request_id=request_id,
                    )
        except SQLAlchemyError as error:
            self.breaker.record_failure()
            logger.warning("quarantine write dropped: %s", error)
        else:
            self.breaker.record_success()

    def _set_depth(self, depth: int) -> None:
        self._outbox_depth = depth
        self.metrics.outbox_depth.set(depth)
