"""The work of one adaptive batch, run in the scoring thread: replay stored answers, read history,
score through the shared Predictor, and shape result rows. No asyncio here; no HTTP either.
"""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import polars as pl
import sqlalchemy as sa
from sqlalchemy.engine import Engine
from sqlalchemy.exc import SQLAlchemyError

from inference.contract import Predictor
from inference.records import EVENT_TS_DTYPE, hash_inputs, raw_frame, validate
from inference.store import HISTORY_SCHEMA, PREDICTION_COLUMNS, ResultPath, fetch_history, predictions, utc_now
from serving.breaker import CircuitBreaker
from serving.schemas import ItemError, ItemResult

logger = logging.getLogger(__name__)

# Marks a score computed without account history. The batch path's upsert rewrites a row whose
# input_hash differs, so any later full-history score (batch or online) replaces a degraded one.
DEGRADED_HASH_SUFFIX = "+nohistory"
IDEMPOTENCY_REUSED = "idempotency_key_reused"


@dataclass(frozen=True)
class ItemSpec:
    """A schema-valid transaction as the scoring thread sees it (plain data, no futures)."""

    raw: dict[str, Any]
    key: str
    explicit_key: bool
    request_id: str


@dataclass
class BatchResult:
    results: list[ItemResult]
    rows: list[dict[str, Any]] = field(default_factory=list)
    rejected: list[dict[str, Any]] = field(default_factory=list)
    degraded: bool = False
    cpu_seconds: float = 0.0
    breaker_state: int = 0  # of the scoring process's own breaker, for the metric


class GuardedHistory:
    """Account history from the store behind the breaker; an unreachable store yields no history."""

    def __init__(self, engine: Engine, breaker: CircuitBreaker) -> None:
        self.engine = engine
        self.breaker = breaker
        self.degraded = False

    def history_for(self, targets: pl.DataFrame, history_length: int) -> pl.DataFrame:
        if self.breaker.allow():
            try:
                with self.engine.connect() as conn:
                    history = fetch_history(conn, targets, history_length)
            except SQLAlchemyError as error:
                self.breaker.record_failure()
                logger.warning("history read failed, scoring without history: %s", error)
            else:
                self.breaker.record_success()
                return history
        self.degraded = True
        return pl.DataFrame(schema=HISTORY_SCHEMA)


class ScoringCore:
    def __init__(
        self,
        predictor: Predictor,
        engine: Engine,
        breaker: CircuitBreaker,
        *,
        code_version: str,
    ) -> None:
        self.predictor = predictor
        self.engine = engine
        self.breaker = breaker
        self.code_version = code_version

    @property
    def model_version(self) -> str:
        return self.predictor.model_version

    def score(self, items: list[ItemSpec], *, lookup: bool = True) -> BatchResult:
        cpu_started = time.thread_time()
        checked = validate(raw_frame([item.raw for item in items]))
        checked = checked.with_columns(hash_inputs(checked))
        hashes: list[str] = checked["input_hash"].to_list()
        answers: list[ItemResult | None] = [None] * len(items)
        if lookup:
            self._replay_stored(items, hashes, answers)
        pending = [i for i, answer in enumerate(answers) if answer is None]
        outcome = BatchResult(results=[])
        if pending:
            history = GuardedHistory(self.engine, self.breaker)
            scored = self.predictor.predict(checked[pending], history)
            outcome.degraded = history.degraded
            batch_id = uuid.uuid4().hex
            produced_at = utc_now()
            for position, row in zip(pending, scored.iter_rows(named=True), strict=True):
                answers[position] = self._answer(items[position], row, batch_id, produced_at, outcome)
        outcome.results = [answer for answer in answers if answer is not None]
        outcome.cpu_seconds = time.thread_time() - cpu_started
        outcome.breaker_state = int(self.breaker.state)
        return outcome

    def _answer(
        self,
        item: ItemSpec,
        row: dict[str, Any],
        batch_id: str,
        produced_at: datetime,
        outcome: BatchResult,
    ) -> ItemResult:
        common = {
            "transaction_id": item.raw["transaction_id"],
            "model_version": self.model_version,
            "path": ResultPath.ONLINE.value,
            "request_id": item.request_id,
            "batch_id": batch_id,
            "produced_at": produced_at,
            "input_hash": row["input_hash"],
            "degraded": outcome.degraded,
        }
        if row["reject_reason"] is not None:
            outcome.rejected.append(
                {
                    **item.raw,
                    "reject_reason": row["reject_reason"],
                    "reject_detail": row["reject_detail"],
                    "request_id": item.request_id,
                }
            )
            return ItemResult(
                status="error", error=ItemError(reason=row["reject_reason"], detail=row["reject_detail"]), **common
            )
        stored_hash = row["input_hash"] + (DEGRADED_HASH_SUFFIX if outcome.degraded else "")
        outcome.rows.append(
            {
                "transaction_id": item.raw["transaction_id"],
                "model_version": self.model_version,
                "score": float(row["score"]),
                "path": ResultPath.ONLINE.value,
                "run_id": None,
                "partition_key": None,
                "request_id": item.request_id,
                "batch_id": batch_id,
                "code_version": self.code_version,
                "input_hash": stored_hash,
                # Unknown when degraded: the empty history scored is not the account's history.
                "history_hash": None if outcome.degraded else row["history_hash"],
                "idempotency_key": item.key,
                "produced_at": produced_at,
            }
        )
        return ItemResult(status="scored", score=float(row["score"]), **common)

    def _replay_stored(self, items: list[ItemSpec], hashes: list[str], answers: list[ItemResult | None]) -> None:
        """Answer retries from `predictions`: by explicit key, else by (transaction, model version)."""
        if not self.breaker.allow():
            return
        try:
            stored = find_stored(
                self.engine,
                model_version=self.model_version,
                transaction_ids=[item.raw["transaction_id"] for item in items],
                keys=[item.key for item in items if item.explicit_key],
            )
        except SQLAlchemyError as error:
            self.breaker.record_failure()
            logger.warning("idempotency lookup failed; scoring afresh: %s", error)
            return
        self.breaker.record_success()
        by_key = {row["idempotency_key"]: row for row in stored if row["idempotency_key"] is not None}
        by_pair = {row["transaction_id"]: row for row in stored if row["model_version"] == self.model_version}
        for position, (item, digest) in enumerate(zip(items, hashes, strict=True)):
            keyed = by_key.get(item.key) if item.explicit_key else None
            if keyed is not None:
                same_input = keyed["transaction_id"] == item.raw["transaction_id"] and keyed["input_hash"].startswith(
                    digest
                )
                answers[position] = _replayed(keyed) if same_input else _reused_key(item, keyed)
                continue
            paired = by_pair.get(item.raw["transaction_id"])
            # A degraded row is provisional: with the history readable again it is scored afresh.
            if paired is not None and paired["input_hash"] == digest:
                answers[position] = _replayed(paired)


def find_stored(
    engine: Engine, *, model_version: str, transaction_ids: list[str], keys: list[str]
) -> list[dict[str, Any]]:
    p = predictions.c
    condition = sa.and_(p.model_version == model_version, p.transaction_id.in_(transaction_ids))
    if keys:
        condition = sa.or_(condition, p.idempotency_key.in_(keys))
    with engine.connect() as conn:
        return [dict(row._mapping) for row in conn.execute(sa.select(predictions).where(condition))]


def _replayed(row: dict[str, Any]) -> ItemResult:
    input_hash: str = row["input_hash"]
    degraded = input_hash.endswith(DEGRADED_HASH_SUFFIX)
    return ItemResult(
        transaction_id=row["transaction_id"],
        status="scored",
        score=row["score"],
        model_version=row["model_version"],
        path=row["path"],
        request_id=row["request_id"],
        batch_id=row["batch_id"],
        produced_at=_as_utc(row["produced_at"]),
        input_hash=input_hash.removesuffix(DEGRADED_HASH_SUFFIX),
        degraded=degraded,
    )


def _reused_key(item: ItemSpec, row: dict[str, Any]) -> ItemResult:
    return ItemResult(
        transaction_id=item.raw["transaction_id"],
        status="error",
        model_version=row["model_version"],
        path=ResultPath.ONLINE.value,
        request_id=item.request_id,
        produced_at=utc_now(),
        error=ItemError(
            reason=IDEMPOTENCY_REUSED,
            detail=f"key {item.key!r} already answered transaction {row['transaction_id']!r} with other input",
        ),
    )


def _as_utc(moment: datetime) -> datetime:
    # SQLite hands back naive datetimes; every stored instant is UTC.
    return moment.replace(tzinfo=UTC) if moment.tzinfo is None else moment.astimezone(UTC)


def prediction_frame(rows: list[dict[str, Any]]) -> pl.DataFrame:
    """Rows as a frame of the writable `predictions` columns; optional columns may be absent."""
    schema: dict[str, pl.DataType] = {}
    for name in PREDICTION_COLUMNS:
        column_type = predictions.c[name].type
        schema[name] = (
            pl.Float64()
            if isinstance(column_type, sa.Float)
            else EVENT_TS_DTYPE
            if isinstance(column_type, sa.DateTime)
            else pl.String()
        )
    return pl.DataFrame([{name: row.get(name) for name in PREDICTION_COLUMNS} for row in rows], schema=schema)
