"""The work of one adaptive batch, run in the scoring process: read history, score through the
shared Predictor, replay an answer already given for exactly this input and history, and shape
result rows. No asyncio here; no HTTP either.
"""

from __future__ import annotations

import collections
import logging
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import polars as pl
import sqlalchemy as sa
from sqlalchemy.engine import Engine
from sqlalchemy.exc import SQLAlchemyError

from inference.contract import Predictor
from inference.records import hash_inputs, raw_frame, validate
from inference.spec import LoadedSpec
from inference.store import (
    NO_HISTORY,
    OnlineProducer,
    ResultPath,
    fetch_history,
    online_answers,
    prediction_rows,
    record_table,
    utc_now,
)
from serving.breaker import CircuitBreaker, read_reconnecting
from serving.schemas import ItemError, ItemResult, api_models

logger = logging.getLogger(__name__)

# Answers this process gave, for replays that arrive before the result writer has stored them.
_RECENT_ANSWERS = 50_000
# A remembered answer is a tuple of these columns as a stored row holds them, so `_replayed`
# rebuilds either: plain values, which the garbage collector stops tracking, unlike models. The
# record's id is the answer's key.
_REMEMBERED_FIELDS = (
    "score",
    "model_version",
    "path",
    "request_id",
    "batch_id",
    "produced_at",
    "input_hash",
    "degraded",
    "unseen_fields",
)


@dataclass(frozen=True)
class ItemSpec:
    """A schema-valid record as the scoring process sees it (plain data, no futures)."""

    raw: dict[str, Any]
    record_id: str  # the spec's id field of `raw`, read once where the item is made
    request_id: str
    idempotency_key: str | None = None  # the client's, for lineage; replays are decided before batching


@dataclass
class BatchResult:
    results: list[ItemResult]
    rows: list[dict[str, Any]] = field(default_factory=list)
    rejected: list[dict[str, Any]] = field(default_factory=list)
    degraded: bool = False
    cpu_seconds: float = 0.0
    breaker_state: int = 0  # of the scoring process's own breaker, for the metric


def ping_store(engine: Engine) -> None:
    """The breakers' probe: one round trip, on a connection the batches' reads then reuse."""
    read_reconnecting(engine, lambda conn: conn.execute(sa.text("SELECT 1")))


class GuardedHistory:
    """Entity history from the store behind the breaker; an unreachable store yields no history.
    A model that reads none (K = 0, or a spec without an entity) reads nothing from the store."""

    def __init__(self, spec: LoadedSpec, engine: Engine, breaker: CircuitBreaker) -> None:
        self.spec = spec
        self.engine = engine
        self.breaker = breaker
        self.degraded = False

    def history_for(self, targets: pl.DataFrame, history_length: int) -> pl.DataFrame:
        if self.spec.history_entity(history_length) is None:
            # The features read no history at K = 0: an empty frame of any schema will do.
            return pl.DataFrame(schema=record_table(self.spec).history_schema)
        if self.breaker.allow():
            try:
                history = read_reconnecting(
                    self.engine, lambda conn: fetch_history(self.spec, conn, targets, history_length), self.breaker
                )
            except SQLAlchemyError as error:
                self.breaker.record_failure()
                logger.warning("history read failed, scoring without history: %s", error)
            else:
                self.breaker.record_success()
                return history
        self.degraded = True
        return pl.DataFrame(schema=record_table(self.spec).history_schema)


class ScoringCore:
    """One model version's scoring of adaptive batches, in the scoring process.

    Every item is scored; an item whose (record, model version, input, history) was answered
    before gets that earlier answer instead, so a true replay returns what the client got then and
    writes nothing, and a changed body or a changed history is always a fresh answer.
    """

    def __init__(
        self,
        spec: LoadedSpec,
        predictor: Predictor,
        engine: Engine,
        breaker: CircuitBreaker,
        *,
        code_version: str,
    ) -> None:
        self.spec = spec
        self.results = api_models(spec).item_result
        self.predictor = predictor
        self.engine = engine
        self.breaker = breaker
        self.code_version = code_version
        self._recent: collections.OrderedDict[tuple[str, str], tuple[Any, ...]] = collections.OrderedDict()

    @property
    def model_version(self) -> str:
        return self.predictor.model_version

    def score(self, items: list[ItemSpec], *, lookup: bool = True) -> BatchResult:
        """`lookup`: replay earlier answers (off only for measurements of the scoring itself)."""
        cpu_started = time.thread_time()
        outcome = BatchResult(results=[])
        answers: list[ItemResult | None] = [None] * len(items)
        for positions in _rounds_of_distinct_records(items):
            part = [items[i] for i in positions]
            for position, answer in zip(positions, self._score_round(part, outcome, lookup=lookup), strict=True):
                answers[position] = answer
        outcome.results = [answer for answer in answers if answer is not None]
        outcome.cpu_seconds = time.thread_time() - cpu_started
        outcome.breaker_state = int(self.breaker.state)
        return outcome

    def _score_round(self, items: list[ItemSpec], outcome: BatchResult, *, lookup: bool) -> list[ItemResult]:
        checked = validate(self.spec, raw_frame(self.spec, [item.raw for item in items]))
        # hstack, not with_columns: that is a polars query of its own.
        checked = checked.hstack([hash_inputs(self.spec, checked)])
        history = GuardedHistory(self.spec, self.engine, self.breaker)
        scored = self.predictor.predict(checked, history)
        outcome.degraded = outcome.degraded or history.degraded
        # A degraded score replays nothing: a store that just failed the history read is not asked again.
        stored = self._stored_answers(items) if lookup and not history.degraded else {}
        batch_id = uuid.uuid4().hex
        produced_at = utc_now()
        answers = []
        for item, row in zip(items, scored.iter_rows(named=True), strict=True):
            # A degraded score read an empty history, not the account's: it replays nothing and is
            # provisional, so it is never replayed either.
            history_hash = None if history.degraded else row["history_hash"]
            answer_id = (item.record_id, answer_key(row["input_hash"], history_hash))
            earlier = self._recall(answer_id) or stored.get(answer_id) if lookup and history_hash else None
            if earlier is not None and row["reject_reason"] is None:
                answers.append(earlier)
                continue
            answer = self._answer(item, row, batch_id, produced_at, outcome)
            if answer.status == "scored" and history_hash is not None:
                self._remember(answer_id, answer)
            answers.append(answer)
        return answers

    def _stored_answers(self, items: list[ItemSpec]) -> dict[tuple[str, str], ItemResult]:
        """Online answers already stored for these records under this version, by answer key."""
        if not self.breaker.allow():
            return {}
        try:
            record_ids = [item.record_id for item in items]
            rows = read_reconnecting(
                self.engine,
                lambda conn: online_answers(conn, model_version=self.model_version, record_ids=record_ids),
                self.breaker,
            )
        except SQLAlchemyError as error:
            self.breaker.record_failure()
            logger.warning("stored-answer lookup failed; answering afresh: %s", error)
            return {}
        self.breaker.record_success()
        return {(row["record_id"], row["answer_key"]): self._replayed(row["record_id"], row) for row in rows}

    def _remember(self, answer_id: tuple[str, str], answer: ItemResult) -> None:
        """Only scored answers: an error is never replayed."""
        # getattr, not model_dump: this runs for every scored item.
        values = [
            ",".join(answer.unseen_fields) if name == "unseen_fields" else getattr(answer, name)
            for name in _REMEMBERED_FIELDS
        ]
        self._recent[answer_id] = tuple(values)
        while len(self._recent) > _RECENT_ANSWERS:
            self._recent.popitem(last=False)

    def _recall(self, answer_id: tuple[str, str]) -> ItemResult | None:
        remembered = self._recent.get(answer_id)
        if remembered is None:
            return None
        return self._replayed(answer_id[0], dict(zip(_REMEMBERED_FIELDS, remembered, strict=True)))

    def _replayed(self, record_id: str, row: dict[str, Any]) -> ItemResult:
        return self.results.for_record(
            record_id,
            status="scored",
            score=row["score"],
            model_version=row["model_version"],
            path=row["path"],
            request_id=row["request_id"],
            batch_id=row["batch_id"],
            produced_at=_as_utc(row["produced_at"]),
            input_hash=row["input_hash"],
            degraded=bool(row["degraded"]),
            unseen_fields=[name for name in (row["unseen_fields"] or "").split(",") if name],
        )

    def _answer(
        self,
        item: ItemSpec,
        row: dict[str, Any],
        batch_id: str,
        produced_at: datetime,
        outcome: BatchResult,
    ) -> ItemResult:
        common = {
            self.spec.id.name: item.record_id,
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
            return self.results(
                status="error", error=ItemError(reason=row["reject_reason"], detail=row["reject_detail"]), **common
            )
        outcome.rows.append(
            prediction_rows(
                row,
                producer=OnlineProducer(item.request_id, batch_id, self.code_version),
                model_version=self.model_version,
                produced_at=produced_at,
                # Degraded: the empty history scored is not the account's, so its hash is unknown.
                degraded=outcome.degraded,
                idempotency_key=item.idempotency_key,
            )
        )
        unseen = row["unseen_fields"].split(",") if row["unseen_fields"] else []
        return self.results(status="scored", score=float(row["score"]), unseen_fields=unseen, **common)


def answer_key(input_hash: str, history_hash: str | None) -> str:
    """The online answer's place in `predictions`' key (see store.answer_key_expr)."""
    return f"{input_hash}|{history_hash or NO_HISTORY}"


def _rounds_of_distinct_records(items: list[ItemSpec]) -> Iterator[list[int]]:
    """Positions split so that no round holds one record twice (two requests may send the
    same id with different bodies): within a frame, validation refuses a repeated id, and the
    features would read one version as the other's history."""
    pending = list(range(len(items)))
    while pending:
        seen: set[str] = set()
        this_round: list[int] = []
        later: list[int] = []
        for position in pending:
            record_id = items[position].record_id
            (later if record_id in seen else this_round).append(position)
            seen.add(record_id)
        yield this_round
        pending = later


def _as_utc(moment: datetime) -> datetime:
    # SQLite hands back naive datetimes; every stored instant is UTC.
    return moment.replace(tzinfo=UTC) if moment.tzinfo is None else moment.astimezone(UTC)
