"""The scorer's moving parts in-process, with hand-written fakes for the scoring step:
coalescing, per-item isolation, deadlines, the outbox and its drain, a dead scoring process."""

from __future__ import annotations

import asyncio
import gc
import multiprocessing
import threading
import time
from collections.abc import Callable
from concurrent.futures import BrokenExecutor, Future, ThreadPoolExecutor
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
import torch
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy.engine import Engine

from inference.contract import TorchPredictor
from inference.store import read_predictions
from serving.admission import Decision
from serving.app import answer
from serving.backends import ScoringBackend
from serving.batcher import SCORING_PROCESS_DIED, Reservation
from serving.breaker import CircuitBreaker
from serving.gate import ScoreCall
from serving.lifecycle import PoolSupervisor
from serving.outbox import Outbox, PartlyWritten
from serving.runtime import RESTORE_ATTEMPTS_BEFORE_RESTART, DeadlineExceeded, OnlineScorer, Shed
from serving.schemas import ItemError, ItemResult
from serving.scoring import BatchResult, ItemSpec, ScoringCore
from serving.scoring_process import ScoringProcess
from tandem_specs.transactions.model import ModelConfig
from tests.reference import REFERENCE, Transaction
from tests.serving.support import score_or_hang, scored_batch, started_scorer, transaction
from tests.shared import reference_model, until_async

MODEL = "risk_model:fake"
POISON = "poison"


class FakeScoring:
    """Scores every item 0.25; a batch holding the poison id raises, as a crashing step would."""

    def __init__(self, delay_s: float = 0.0) -> None:
        self.delay_s = delay_s
        self.batches: list[list[str]] = []
        self.lock = threading.Lock()

    def __call__(self, specs: list[ItemSpec]) -> BatchResult:
        ids = [str(spec.raw["transaction_id"]) for spec in specs]
        with self.lock:
            self.batches.append(ids)
        time.sleep(self.delay_s)
        if POISON in ids:
            raise ValueError("poisoned batch")
        return scored_batch(specs, model_version=MODEL, score=0.25, batch_id="b")

    @property
    def scored_ids(self) -> list[str]:
        return [tx for batch in self.batches for tx in batch]


async def scorer_for(
    fake: Callable[[list[ItemSpec]], BatchResult], engine: Engine, tmp_path: Path, **overrides: object
) -> OnlineScorer:
    return await started_scorer(fake, engine, tmp_path / "outbox.sqlite3", model_version=MODEL, **overrides)


def test_a_batch_that_raises_fails_only_the_poison_item(sqlite_engine: Engine, tmp_path: Path) -> None:
    async def scenario() -> list[ItemResult]:
        fake = FakeScoring(delay_s=0.02)
        scorer = await scorer_for(fake, sqlite_engine, tmp_path)
        # The first request occupies the scoring thread so the next ones share one batch.
        first = asyncio.create_task(
            scorer.score([transaction("warm")], request_id="r0", idempotency_key=None, deadline=time.monotonic() + 5)
        )
        await until_async(lambda: fake.batches)
        calls = [
            scorer.score([transaction(tx)], request_id=tx, idempotency_key=None, deadline=time.monotonic() + 5)
            for tx in ("a", POISON, "b", "c")
        ]
        answers = await asyncio.gather(first, *calls)
        await scorer.close()
        assert ["a", POISON, "b", "c"] in fake.batches, "the four shared a batch"
        return [results[0] for results, _ in answers]

    results = {r.transaction_id: r for r in asyncio.run(scenario())}
    assert results[POISON].status == "error"
    assert results[POISON].error == ItemError(reason="internal_error", detail="ValueError: poisoned batch")
    assert all(results[tx].status == "scored" for tx in ("warm", "a", "b", "c"))


def test_a_request_past_its_deadline_is_never_started(sqlite_engine: Engine, tmp_path: Path) -> None:
    async def scenario() -> tuple[float, FakeScoring]:
        fake = FakeScoring(delay_s=0.2)
        scorer = await scorer_for(fake, sqlite_engine, tmp_path, p99_target_ms=1000)
        busy = asyncio.create_task(
            scorer.score([transaction("slow")], request_id="r0", idempotency_key=None, deadline=time.monotonic() + 5)
        )
        await until_async(lambda: fake.batches)  # "slow" holds the scoring thread for 0.2 s
        started = time.monotonic()
        with pytest.raises(DeadlineExceeded):
            await scorer.score(
                [transaction("late")], request_id="r1", idempotency_key=None, deadline=time.monotonic() + 0.05
            )
        elapsed = time.monotonic() - started
        await busy
        await asyncio.sleep(0.05)  # room for "late" to be started wrongly after the batch ahead
        await scorer.close()
        return elapsed, fake

    elapsed, fake = asyncio.run(scenario())
    assert elapsed < 0.15, "answered at the deadline, not when the batch ahead finished"
    assert "late" not in fake.scored_ids


def test_an_item_that_expires_in_the_queue_leaves_it_counted_once(sqlite_engine: Engine, tmp_path: Path) -> None:
    """The batcher expires an item whose deadline passed before its batch started, and its waiter,
    woken in the same turn of a busy event loop, gives it up: the queue must count it out once. Counted
    out twice, the depth went below zero for good, and every later predicted wait ran a batch short."""

    async def scenario() -> int:
        fake = FakeScoring(delay_s=0.05)
        scorer = await scorer_for(fake, sqlite_engine, tmp_path, p99_target_ms=1000)
        busy = asyncio.create_task(
            scorer.score([transaction("busy")], request_id="r0", idempotency_key=None, deadline=time.monotonic() + 5)
        )
        await until_async(lambda: fake.batches)
        late = asyncio.create_task(
            scorer.score([transaction("late")], request_id="r1", idempotency_key=None, deadline=time.monotonic() + 0.02)
        )
        await asyncio.sleep(0)  # "late" is queued behind "busy"
        # The loop busy past the batch's end and the deadline: the batcher and the waiter wake in one turn.
        time.sleep(0.15)
        with pytest.raises(DeadlineExceeded):
            await late
        await busy
        assert scorer.batcher is not None
        depth = scorer.batcher.queued
        await scorer.close()
        return depth

    assert asyncio.run(scenario()) == 0


def test_an_identical_request_never_joins_an_item_its_first_sender_was_refused_for(
    sqlite_engine: Engine, tmp_path: Path
) -> None:
    """Two identical requests in one turn of the loop, the first shed at admission: the second must
    be judged on its own (here shed too), not joined to the refused item and answered 504 as if its
    deadline had passed."""

    async def scenario() -> list[BaseException | tuple[list[ItemResult], float]]:
        fake = FakeScoring(delay_s=0.2)
        scorer = await scorer_for(fake, sqlite_engine, tmp_path, queue_capacity=1)
        deadline = time.monotonic() + 5
        busy = asyncio.create_task(
            scorer.score([transaction("busy")], request_id="r0", idempotency_key=None, deadline=deadline)
        )
        await until_async(lambda: fake.batches)
        queued = asyncio.create_task(
            scorer.score([transaction("queued")], request_id="r1", idempotency_key=None, deadline=deadline)
        )
        await asyncio.sleep(0)  # the queue (capacity 1) is full behind "busy"
        answers = await asyncio.gather(
            scorer.score([transaction("same")], request_id="r2", idempotency_key=None, deadline=deadline),
            scorer.score([transaction("same")], request_id="r3", idempotency_key=None, deadline=deadline),
            return_exceptions=True,
        )
        await asyncio.gather(busy, queued)
        await scorer.close()
        return answers

    first, second = asyncio.run(scenario())
    assert isinstance(first, Shed) and first.decision.reason == "queue_full"
    assert isinstance(second, Shed) and second.decision.reason == "queue_full"


def test_outbox_is_durable_and_drains_idempotently(tmp_path: Path) -> None:
    outbox = Outbox(tmp_path / "outbox.sqlite3")
    rows = [{"transaction_id": f"t{i}", "produced_at": datetime(2026, 11, 2, tzinfo=UTC)} for i in range(5)]
    outbox.append(rows)
    outbox.close()

    reopened = Outbox(tmp_path / "outbox.sqlite3")
    assert reopened.depth() == 5

    def failing(_: list[dict[str, object]]) -> None:
        raise sa.exc.OperationalError("insert", {}, Exception("database is down"))

    with pytest.raises(sa.exc.OperationalError):
        reopened.drain(failing, chunk=2)
    assert reopened.depth() == 5, "nothing is deleted before the database has it"

    received: list[dict[str, object]] = []
    assert reopened.drain(received.extend, chunk=2) == 5
    assert reopened.depth() == 0
    assert received == rows


class DeadPool(ThreadPoolExecutor):
    """A pool whose process is gone: every submission fails as a dead ProcessPoolExecutor's does."""

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        raise BrokenExecutor("the scoring process died")


def test_a_chunk_written_in_part_leaves_only_its_unwritten_rows_in_the_outbox(tmp_path: Path) -> None:
    """The writer quarantined the chunk's first row and wrote its second before the database went
    away: kept whole, the chunk's retry quarantined that row again at every drain."""
    outbox = Outbox(tmp_path / "outbox.sqlite3")
    outbox.append([{"transaction_id": f"t{i}"} for i in range(4)])
    handed: list[list[object]] = []

    def down_after_two(rows: list[dict[str, object]]) -> None:
        handed.append([row["transaction_id"] for row in rows])
        raise PartlyWritten(rows[2:])

    with pytest.raises(PartlyWritten):
        outbox.drain(down_after_two, chunk=10)
    assert outbox.depth() == 2
    assert outbox.drain(lambda rows: handed.append([row["transaction_id"] for row in rows]), chunk=10) == 2
    assert handed == [["t0", "t1", "t2", "t3"], ["t2", "t3"]]


def test_a_dead_scoring_process_is_replaced_and_liveness_fails_only_when_that_keeps_failing(
    sqlite_engine: Engine, tmp_path: Path
) -> None:
    attempts: list[str] = []

    def load(tag: str) -> ScoringBackend:
        attempts.append(tag)
        if len(attempts) <= RESTORE_ATTEMPTS_BEFORE_RESTART:
            raise RuntimeError("model file unreadable")
        return ScoringBackend(tag, ThreadPoolExecutor(max_workers=1), FakeScoring())

    async def scenario() -> None:
        scorer = await scorer_for(FakeScoring(), sqlite_engine, tmp_path)
        scorer.swap(ScoringBackend(MODEL, DeadPool(max_workers=1), FakeScoring()))
        supervisor = PoolSupervisor(scorer, load=load, interval_s=60, load_timeout_s=5)

        results, _ = await scorer.score(
            [transaction("tx-1")], request_id="r1", idempotency_key=None, deadline=time.monotonic() + 5
        )
        assert results[0].error is not None and results[0].error.reason == SCORING_PROCESS_DIED
        assert not scorer.scoring_available() and not scorer.ready()
        assert scorer.alive(), "repair is in-process first"

        for _ in range(RESTORE_ATTEMPTS_BEFORE_RESTART):
            assert not await supervisor.restore_once()
        assert not scorer.alive(), "past in-process repair: ask to be restarted"

        assert await supervisor.restore_once()
        assert scorer.scoring_available() and scorer.alive() and scorer.ready()
        results, _ = await scorer.score(
            [transaction("tx-2")], request_id="r2", idempotency_key=None, deadline=time.monotonic() + 5
        )
        assert results[0].status == "scored"
        await scorer.close()

    asyncio.run(scenario())
    assert attempts == [MODEL] * (RESTORE_ATTEMPTS_BEFORE_RESTART + 1)


def test_a_stuck_scoring_process_is_stopped_and_replaced(sqlite_engine: Engine, tmp_path: Path) -> None:
    """A scoring process alive but never answering held its batch, and every later one, forever:
    each request a 504. Past the longest deadline its batch is lost as a dead process's is."""

    async def scenario() -> None:
        scorer = await scorer_for(FakeScoring(), sqlite_engine, tmp_path, request_timeout_ms=500)
        stuck = ScoringProcess(multiprocessing.get_context("forkserver"))
        scorer.swap(ScoringBackend(MODEL, stuck, score_or_hang))
        assert scorer.batcher is not None
        scorer.batcher.stuck_after_s = 1.5
        learnt = scorer.cost.batch_seconds(1)

        started = time.monotonic()
        hanging = asyncio.create_task(
            scorer.score([transaction("hang")], request_id="r1", idempotency_key=None, deadline=time.monotonic() + 30)
        )
        await until_async(lambda: scorer.batcher is not None and scorer.batcher.in_flight_for() > 0)
        assert scorer.ready(), "a batch within the default deadline keeps the service in rotation"
        await until_async(lambda: not scorer.ready(), timeout_s=1.4)
        assert not hanging.done() and scorer.scoring_available(), "out of rotation before the stuck bound"
        results, _ = await hanging
        # The bound is 1.5 s; stopping the process takes its share of a loaded machine, far from 30 s.
        assert 1.5 <= time.monotonic() - started < 15, "lost at the stuck bound, not at the deadline"
        assert results[0].error is not None and results[0].error.reason == SCORING_PROCESS_DIED
        assert not stuck.process.is_alive()
        assert not scorer.scoring_available() and not scorer.ready() and scorer.alive()
        assert scorer.cost.batch_seconds(1) == learnt, "the lost batch taught the cost model nothing"

        supervisor = PoolSupervisor(
            scorer,
            load=lambda tag: ScoringBackend(tag, ThreadPoolExecutor(max_workers=1), FakeScoring()),
            interval_s=60,
            load_timeout_s=5,
        )
        assert await supervisor.restore_once()
        results, _ = await scorer.score(
            [transaction("tx-2")], request_id="r2", idempotency_key=None, deadline=time.monotonic() + 5
        )
        assert results[0].status == "scored"
        await scorer.close()

    asyncio.run(scenario())


def test_a_scoring_step_that_raises_timeout_error_fails_its_item_not_the_process(
    sqlite_engine: Engine, tmp_path: Path
) -> None:
    """The stuck bound is the batcher's own: a TimeoutError the scoring step raises is that
    item's failure, and the process serves on."""

    def times_out(specs: list[ItemSpec]) -> BatchResult:
        if any(spec.record_id == POISON for spec in specs):
            raise TimeoutError("a read timed out")
        return scored_batch(specs, model_version=MODEL, batch_id="b")

    async def scenario() -> None:
        scorer = await scorer_for(times_out, sqlite_engine, tmp_path)
        assert scorer.batcher is not None
        scorer.batcher.stuck_after_s = 5.0
        results, _ = await scorer.score(
            [transaction(POISON), transaction("tx-1")],
            request_id="r1",
            idempotency_key=None,
            deadline=time.monotonic() + 5,
        )
        assert [r.status for r in results] == ["error", "scored"]
        assert results[0].error is not None and results[0].error.reason == "internal_error"
        assert scorer.scoring_available()
        await scorer.close()

    asyncio.run(scenario())


def test_an_admitted_request_holds_a_place_in_the_queue_until_its_items_take_it(
    sqlite_engine: Engine, tmp_path: Path
) -> None:
    """`admit` runs before the body is read: each admitted request counts as one queued item, so a
    burst read in one turn of the loop cannot all see an empty queue; its items then take its place
    (no second admission), and a request refused for its body gives its place back."""

    async def scenario() -> None:
        scorer = await scorer_for(FakeScoring(), sqlite_engine, tmp_path, queue_capacity=3)
        deadline = time.monotonic() + 5
        places = [scorer.admit(deadline) for _ in range(3)]
        assert all(isinstance(place, Reservation) for place in places)
        refusal = scorer.admit(deadline)
        assert isinstance(refusal, Decision) and refusal.reason == "queue_full"
        assert shed_count(scorer, "queue_full") == 1, "a refusal at admission is counted as shed"
        # The queue is full of reservations, yet a reserved request is scored: its items take its place.
        reserved = places[0]
        assert isinstance(reserved, Reservation)
        results, _ = await scorer.score(
            [transaction("tx-1")], request_id="r1", idempotency_key=None, deadline=deadline, reservation=reserved
        )
        assert [r.status for r in results] == ["scored"]
        # Without one, an in-process caller is admitted inside `score`, against the two places still held.
        with pytest.raises(Shed) as shed:
            await scorer.score(
                [transaction(f"tx-{i}") for i in range(2)], request_id="r2", idempotency_key=None, deadline=deadline
            )
        assert shed.value.decision.reason == "queue_full"
        for place in places[1:]:
            assert isinstance(place, Reservation)
            place.release()  # refused for its body, or the client left
            place.release()  # given back once, however often released
        assert all(isinstance(scorer.admit(deadline), Reservation) for _ in range(3)), "every place back"
        await scorer.close()

    asyncio.run(scenario())


def test_a_request_is_refused_before_it_is_read_once_even_one_item_would_wait_too_long(
    sqlite_engine: Engine, tmp_path: Path
) -> None:
    """The one admission rule, before the body is read: refused when the predicted wait is over
    the p99 target, or over the request's own deadline; an idle scorer refuses nothing."""

    async def scenario() -> None:
        fake = FakeScoring(delay_s=0.3)
        scorer = await scorer_for(fake, sqlite_engine, tmp_path, p99_target_ms=50)
        scorer.cost.calibrate([(1, 0.3), (64, 0.32)])  # what warm-up would measure of this scoring step
        place = scorer.admit(time.monotonic() + 5)
        assert isinstance(place, Reservation)
        place.release()
        first = asyncio.create_task(
            scorer.score([transaction("tx-1")], request_id="r1", idempotency_key=None, deadline=time.monotonic() + 5)
        )
        await until_async(lambda: fake.batches)  # tx-1 is in its batch now, for 0.3 s
        refusal = scorer.admit(time.monotonic() + 5)
        assert isinstance(refusal, Decision) and refusal.reason == "over_target"
        assert refusal.predicted_wait_s > 0.05 and refusal.retry_after_s >= 1
        tight = scorer.admit(time.monotonic() + 0.01)
        assert isinstance(tight, Decision) and tight.reason == "over_deadline"
        await first
        assert isinstance(scorer.admit(time.monotonic() + 5), Reservation), "an idle scorer refuses nothing"
        assert (shed_count(scorer, "over_target"), shed_count(scorer, "over_deadline")) == (1, 1)
        await scorer.close()

    asyncio.run(scenario())


def shed_count(scorer: OnlineScorer, reason: str) -> float:
    text = scorer.metrics.exposition().decode()
    return sum(
        found.value
        for family in text_string_to_metric_families(text)
        for found in family.samples
        if found.name == "tandem_serving_shed_total" and found.labels == {"reason": reason}
    )


def test_unseen_vocabulary_is_scored_and_flagged_in_the_answer_and_the_stored_row(
    sqlite_engine: Engine, tmp_path: Path
) -> None:
    """The real scoring step (ScoringCore over a small torch model) in the scoring thread: a
    well-formed value outside the training vocabulary is scored through the unknown bucket and
    flagged, in the ItemResult and in the `predictions` row the writer stores."""
    torch.manual_seed(0)
    config = ModelConfig(history_length=4, embedding_dim=4, history_dim=16, hidden_dim=32, head_tail_dim=8)
    predictor = TorchPredictor(model=reference_model(config), model_version=MODEL, spec=REFERENCE)
    core = ScoringCore(REFERENCE, predictor, sqlite_engine, CircuitBreaker(3, 1.0), code_version="test")

    def drifted(tx: str, **changes: str) -> Transaction:
        return transaction(tx).model_copy(update=changes)

    async def scenario() -> list[ItemResult]:
        scorer = await scorer_for(core.score, sqlite_engine, tmp_path)
        results, _ = await scorer.score(
            [
                transaction("known"),
                drifted("new-category", merchant_category="ev_charging"),
                drifted("new-everything", merchant_category="ev_charging", country="KR", currency="KRW"),
            ],
            request_id="r1",
            idempotency_key=None,
            deadline=time.monotonic() + 30,
        )
        scorer.writer.flush()
        await scorer.close()
        return results

    results = {r.transaction_id: r for r in asyncio.run(scenario())}
    assert {tx: r.status for tx, r in results.items()} == dict.fromkeys(results, "scored")
    assert all(r.score is not None and 0.0 < r.score < 1.0 for r in results.values())
    assert results["known"].unseen_fields == []
    assert results["new-category"].unseen_fields == ["merchant_category"]
    assert results["new-everything"].unseen_fields == ["country", "currency", "merchant_category"]
    assert "unseen_fields" in results["known"].model_dump()

    with sqlite_engine.connect() as conn:
        stored = read_predictions(conn)
    assert dict(zip(stored["record_id"], stored["unseen_fields"], strict=True)) == {
        "known": None,
        "new-category": "merchant_category",
        "new-everything": "country,currency,merchant_category",
    }


def test_an_answer_replayed_from_the_scoring_process_memory_is_the_one_given_and_costs_the_collector_nothing(
    sqlite_engine: Engine,
) -> None:
    """Before the writer has stored an answer, a replay of the same input comes from the scoring
    process's memory: the same answer, field for field. That memory holds plain tuples, which the
    garbage collector stops tracking, so its full collections do not walk 50,000 answers."""
    torch.manual_seed(0)
    config = ModelConfig(history_length=4, embedding_dim=4, history_dim=16, hidden_dim=32, head_tail_dim=8)
    predictor = TorchPredictor(model=reference_model(config), model_version=MODEL, spec=REFERENCE)
    core = ScoringCore(REFERENCE, predictor, sqlite_engine, CircuitBreaker(3, 1.0), code_version="test")
    drifted = transaction("drifted").model_copy(update={"country": "KR", "currency": "KRW"})
    sent = [transaction("known"), drifted]

    first = core.score([ItemSpec(raw=tx.to_raw(), record_id=tx.transaction_id, request_id="first") for tx in sent])
    again = core.score([ItemSpec(raw=tx.to_raw(), record_id=tx.transaction_id, request_id="again") for tx in sent])

    assert [r.status for r in first.results] == ["scored", "scored"]
    assert first.results[1].unseen_fields == ["country", "currency"]
    assert again.results == first.results
    assert [r.model_dump_json() for r in again.results] == [r.model_dump_json() for r in first.results]
    assert again.rows == [], "a replay writes nothing"
    gc.collect()
    assert not any(gc.is_tracked(remembered) for remembered in core._recent.values())


def test_a_keyed_duplicate_of_a_request_whose_scoring_process_died_is_answered_503_too(
    sqlite_engine: Engine, tmp_path: Path
) -> None:
    """Handed its first request's error, the duplicate raised one nothing above the scorer answers (a 500)."""

    def call(request_id: str) -> ScoreCall:
        return ScoreCall(
            request_id=request_id,
            arrived=time.monotonic(),
            header_deadline_ms=5000.0,
            header_key="k",
            default_deadline_ms=2000.0,
            max_deadline_ms=9000.0,
        )

    async def scenario() -> list[int]:
        scorer = await scorer_for(FakeScoring(), sqlite_engine, tmp_path)
        scorer.swap(ScoringBackend(MODEL, DeadPool(max_workers=1), FakeScoring()))
        body = [transaction("tx-1")]
        answers = await asyncio.gather(
            answer(call("r1"), scorer, body, None, None), answer(call("r2"), scorer, body, None, None)
        )
        await scorer.close()
        return [response.status_code for response in answers]

    assert asyncio.run(scenario()) == [503, 503]


def test_past_the_aimd_limit_a_request_is_refused_and_its_place_given_back(
    sqlite_engine: Engine, tmp_path: Path
) -> None:
    async def scenario() -> None:
        scorer = await scorer_for(FakeScoring(), sqlite_engine, tmp_path, max_concurrency=1)
        deadline = time.monotonic() + 5
        first = scorer.admit(deadline)
        assert isinstance(first, Reservation)
        refusal = scorer.admit(deadline)
        assert isinstance(refusal, Decision) and refusal.reason == "concurrency_limit"
        assert shed_count(scorer, "concurrency_limit") == 1
        first.release()
        scorer.finished(0.001)  # answered: its slot is free again
        assert isinstance(scorer.admit(deadline), Reservation)
        await scorer.close()

    asyncio.run(scenario())
