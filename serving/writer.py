"""Result persistence off the event loop: coalesced upserts, an outbox when the database is down,
and a drain of that outbox once it is back. One thread owns every write of what clients received,
so batches land in order and nothing on the request path waits on them.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any

import polars as pl
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.exc import SQLAlchemyError

from inference.records import raw_frame, received_columns, validate
from inference.spec import LoadedSpec
from inference.store import (
    RejectStage,
    ResultPath,
    is_missing_schema,
    is_transient_db_error,
    prediction_frame,
    quarantine,
    quarantine_unwritable_result,
    upsert_predictions,
)
from serving.breaker import CircuitBreaker
from serving.metrics import ServingMetrics
from serving.outbox import Outbox, PartlyWritten

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Rows:
    rows: list[dict[str, Any]]


@dataclass(frozen=True)
class _Rejections:
    rows: list[dict[str, Any]]  # RAW columns + reject_reason + reject_detail + request_id


_STOP = object()
SCHEMA_INVALID = "schema_invalid"
# Rows one gathered write may hold (see ResultWriter._gather).
_MAX_GATHERED_ROWS = 4096


def _first_per_answer(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    seen: set[tuple[Any, ...]] = set()
    first = []
    for row in rows:
        # .get: a malformed row must reach the write (and its quarantine), not fail the gathering.
        answer = tuple(row.get(name) for name in ("record_id", "model_version", "path", "input_hash", "history_hash"))
        if answer not in seen:
            seen.add(answer)
            first.append(row)
    return first


def write_prediction_rows(conn: Connection, rows: list[dict[str, Any]]) -> int:
    """Upsert online answers: each distinct answer is a row of its own, never rewritten, so a
    degraded answer is kept beside (not instead of) a full one."""
    return upsert_predictions(conn, prediction_frame(rows)) if rows else 0


class StoreOutage(PartlyWritten):
    """The database cannot be reached (or lacks its schema); `unwritten` are kept for later."""


class ResultWriter:
    """The one writer of the service's results, on a thread of its own: jobs are written in
    submission order; rows an unreachable database cannot take go to the outbox, drained once the
    breaker lets a write through; a row the database refuses as data is quarantined alone.
    """

    def __init__(
        self,
        spec: LoadedSpec,
        engine: Engine,
        breaker: CircuitBreaker,
        outbox: Outbox,
        metrics: ServingMetrics,
        *,
        drain_interval_s: float,
        drain_chunk: int = 2000,
        coalesce_s: float = 0.0,
    ) -> None:
        self.spec = spec
        self.engine = engine
        self.coalesce_s = coalesce_s
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

    def submit_invalid(self, items: list[Any], details: dict[int, str], request_id: str) -> None:
        """Best effort: quarantine schema-invalid items (never scored) by their index in `items`;
        blocking (validation runs polars), so off the event loop."""
        records = [(index, item) for index, item in enumerate(items) if isinstance(item, dict) and index in details]
        if not records:
            return
        received = [item for _, item in records]
        frame = raw_frame(self.spec, received).with_columns(received_columns(self.spec, received))
        reasons = validate(self.spec, frame)["reject_reason"].to_list()
        rows = []
        for (index, item), reason in zip(records, reasons, strict=True):
            rows.append(
                {
                    **item,
                    "reject_reason": reason or SCHEMA_INVALID,
                    "reject_detail": details[index][:500],
                    "request_id": request_id,
                }
            )
            self.metrics.item_errors.labels(reason=reason or SCHEMA_INVALID).inc()
        self.submit_rejections(rows)

    def flush(self) -> None:
        """Block until every submitted job has been written or spilled to the outbox."""
        self._jobs.join()

    def close(self, drain_s: float = 0.0, *, retry_s: float = 0.25) -> int:
        """Stop the writer thread once every submitted job is written or spilled, then drain the
        outbox for up to `drain_s`, retrying while the breaker is open; returns the rows drained.
        """
        if self._thread.is_alive():
            self._jobs.put(_STOP)
            self._thread.join(timeout=30)
        if drain_s <= 0 or not self._outbox_depth:
            return 0
        drained = 0
        deadline = time.monotonic() + drain_s
        while self._outbox_depth and time.monotonic() < deadline:
            drained += self.drain()
            if self._outbox_depth:
                time.sleep(min(retry_s, max(deadline - time.monotonic(), 0.0)))
        if self._outbox_depth:
            logger.warning(
                "shutdown: %d rows drained, %d left in the outbox (lost if the pod goes)", drained, self._outbox_depth
            )
        else:
            logger.info("shutdown: outbox empty (%d rows drained)", drained)
        return drained

    def _run(self) -> None:
        held: object | None = None  # a job taken while gathering rows, handled next, in order
        while True:
            if held is not None:
                job, held = held, None
            else:
                try:
                    job = self._jobs.get(timeout=self.drain_interval_s)
                except queue.Empty:
                    try:
                        self.drain()
                    except Exception:  # as for a job: a writer that dies silently loses every later row
                        logger.exception("outbox drain failed")
                    continue
            taken = 1
            try:
                if job is _STOP:
                    return
                if isinstance(job, _Rows):
                    rows, gathered, held = self._gather(job.rows)
                    taken += gathered
                    self._write(rows)
                elif isinstance(job, _Rejections):
                    self._quarantine(job.rows)
                if self._outbox_depth:
                    self.drain()
            except Exception:  # a writer that dies silently would lose every later row
                logger.exception("result writer job failed")
            finally:
                for _ in range(taken):
                    self._jobs.task_done()

    def _gather(self, rows: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], int, object | None]:
        """`rows` and the row jobs submitted within `coalesce_s` after them, as one write (a write
        costs CPU under the GIL the event loop needs). Returns the rows, the jobs merged in, and a
        job of another kind that ended the gathering (or None). An answer met twice keeps its first
        row: an online answer is never rewritten.
        """
        if self.coalesce_s <= 0:
            return rows, 0, None
        gathered: list[dict[str, Any]] = list(rows)
        merged = 0
        deadline = time.monotonic() + self.coalesce_s
        while len(gathered) < _MAX_GATHERED_ROWS:
            remaining = deadline - time.monotonic()
            try:
                job = self._jobs.get(timeout=remaining) if remaining > 0 else self._jobs.get_nowait()
            except queue.Empty:
                break
            if not isinstance(job, _Rows):
                return _first_per_answer(gathered), merged, job
            gathered += job.rows
            merged += 1
        return (_first_per_answer(gathered) if merged else gathered), merged, None

    def _write(self, rows: list[dict[str, Any]]) -> None:
        if self.breaker.allow():
            try:
                self.store(rows)
            except StoreOutage as outage:
                self.breaker.record_failure()
                rows = outage.unwritten
                logger.warning("prediction write failed; %d rows to the outbox: %s", len(rows), outage.__cause__)
            else:
                self.breaker.record_success()
                return
        self.outbox.append(rows)
        self._set_depth(self._outbox_depth + len(rows))

    def store(self, rows: list[dict[str, Any]]) -> None:
        """Upsert `rows`, bisecting a refused write down to the rows the database refuses as data,
        each quarantined alone so it never holds back the others. Raises StoreOutage, naming the
        rows not yet written, when the database cannot be reached or lacks its schema.
        """
        pending = [rows]
        while pending:
            part = pending.pop()
            try:
                with self.engine.begin() as conn:
                    write_prediction_rows(conn, part)
            except Exception as error:
                unwritten = [row for chunk in (*pending, part) for row in chunk]
                if is_transient_db_error(error) or is_missing_schema(error):
                    raise StoreOutage(unwritten) from error
                if len(part) > 1:
                    middle = len(part) // 2
                    pending += [part[middle:], part[:middle]]
                    continue
                try:
                    self._quarantine_unwritable(part[0], error)
                except StoreOutage as outage:  # the store went away mid-bisection: keep every row left
                    raise StoreOutage(unwritten) from outage.__cause__

    def _quarantine_unwritable(self, row: dict[str, Any], error: Exception) -> None:
        detail = f"{type(error).__name__}: {error}".splitlines()[0]
        try:
            with self.engine.begin() as conn:
                quarantine_unwritable_result(conn, row, detail, path=ResultPath.ONLINE)
        except Exception as second:
            # An outage, or a store without its schema: the row is kept in the outbox for later.
            if is_transient_db_error(second) or is_missing_schema(second):
                raise StoreOutage([row]) from second
            # Nothing storable is left of it; dropping it beats holding back every later row.
            logger.error("dropped an unwritable result row for %r: %s; then %s", row.get("record_id"), detail, second)
            return
        logger.error("quarantined an unwritable result row for %r: %s", row.get("record_id"), detail)

    def drain(self) -> int:
        if not self._outbox_depth or not self.breaker.allow():
            self.metrics.breaker_state.set(int(self.breaker.state))
            return 0
        drained = 0
        try:
            drained = self.outbox.drain(self.store, self.drain_chunk)
        except StoreOutage as outage:
            self.breaker.record_failure()
            logger.warning("outbox drain stopped: %s", outage.__cause__)
        else:
            self.breaker.record_success()
        self._set_depth(self.outbox.depth())
        self.metrics.breaker_state.set(int(self.breaker.state))
        return drained

    def _quarantine(self, rows: list[dict[str, Any]]) -> None:
        # Best effort: a quarantine row lost to an outage costs a diagnostic, never an answer.
        # The payload keeps each field as received ("12;50", not the NaN it reads as).
        frame = raw_frame(self.spec, rows).with_columns(
            *received_columns(self.spec, rows),
            reject_reason=pl.Series([row["reject_reason"] for row in rows], dtype=pl.String),
            reject_detail=pl.Series([row.get("reject_detail") for row in rows], dtype=pl.String),
        )
        by_request: dict[str | None, list[int]] = {}
        for index, row in enumerate(rows):
            by_request.setdefault(row.get("request_id"), []).append(index)
        if not self.breaker.allow():
            return
        try:
            with self.engine.begin() as conn:
                for request_id, positions in by_request.items():
                    quarantine(
                        self.spec,
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
