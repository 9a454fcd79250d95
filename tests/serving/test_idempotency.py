"""Idempotency keys in-process, on SQLite and PostgreSQL: a key names one body; without a key only
a truly identical input is answered from earlier; two server processes (two scorers on one
store) agree because the store decides."""

from __future__ import annotations

import asyncio
import gc
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import Engine

from inference.spec import LoadedSpec
from inference.spec.api import record_model
from inference.store import idempotency_keys, read_predictions
from serving.breaker import CircuitBreaker
from serving.idempotency import IdempotencyKeys, KeyInProgress, KeyReused
from serving.refusals import Refused
from serving.runtime import DeadlineExceeded, OnlineScorer, Shed
from serving.schemas import ItemResult, api_models
from serving.scoring import BatchResult, ItemSpec
from tests.reference import REFERENCE, Transaction
from tests.serving.support import DUPLICATES, check_one_answer_per_key, scored_batch, started_scorer, transaction
from tests.shared import until_async

MODEL = "risk_model:fake"


class AmountScoring:
    """Scores each item by its spec's first numeric (the reference's amount) / 1000, so two bodies
    of one record get two answers."""

    def __init__(self, delay_s: float = 0.0, ls: LoadedSpec = REFERENCE) -> None:
        self.delay_s = delay_s
        self.ls = ls
        self.started = 0  # batches begun (each then takes delay_s)
        self.scored: list[tuple[str, float]] = []
        self.lock = threading.Lock()

    def __call__(self, specs: list[ItemSpec]) -> BatchResult:
        with self.lock:
            self.started += 1
        time.sleep(self.delay_s)
        with self.lock:
            self.scored.extend((str(spec.raw[self.ls.id.name]), self._amount(spec)) for spec in specs)
        return scored_batch(specs, model_version=MODEL, batch_id="b", grade=self._by_amount, ls=self.ls)

    def _amount(self, spec: ItemSpec) -> float:
        return float(spec.raw[self.ls.numerics[0].name])

    def _by_amount(self, spec: ItemSpec) -> tuple[float, str]:
        amount = self._amount(spec)
        return amount / 1000, f"h{amount}"


def body(tx: str, amount: float) -> list[Transaction]:
    return [transaction(tx).model_copy(update={"amount": amount})]


def record(ls: LoadedSpec, record_id: str, amount: float) -> list[Any]:
    """`ls`'s example record as `record_id`, its first numeric set to `amount`: a one-record body."""
    example = {**ls.spec.example(), ls.id.name: record_id, ls.numerics[0].name: amount}
    return [record_model(ls).model_validate(example)]


async def scorer_on(
    engine: Engine, tmp_path: Path, fake: AmountScoring, name: str, **overrides: object
) -> OnlineScorer:
    """One server process's scorer, of its scoring's spec: its own outbox, the shared store."""
    outbox = tmp_path / f"outbox-{name}.sqlite3"
    return await started_scorer(fake, engine, outbox, model_version=MODEL, spec=fake.ls, **overrides)


async def ask(scorer: OnlineScorer, request_id: str, key: str | None, transactions: list[Any]) -> ItemResult:
    results, _ = await scorer.score(
        transactions, request_id=request_id, idempotency_key=key, deadline=time.monotonic() + 5
    )
    return results[0]


async def settle(engine: Engine, *scorers: OnlineScorer) -> None:
    """Wait for the key bookkeeping (run off the loop, not awaited): no claim in the store is left
    without its answer (or its release); then let the writer finish."""
    await until_async(lambda: all(row["response"] is not None for row in key_rows(engine)))
    for scorer in scorers:
        scorer.writer.flush()
        await scorer.close()


def key_rows(engine: Engine) -> list[dict[str, object]]:
    with engine.connect() as conn:
        return [dict(row._mapping) for row in conn.execute(sa.select(idempotency_keys))]


def claimed(engine: Engine, key: str, *, answered: bool = False) -> bool:
    """Whether the store holds a claim of `key` (with its answer, when `answered`)."""
    rows = [row for row in key_rows(engine) if row["idempotency_key"] == key]
    return any(row["response"] is not None or not answered for row in rows)


def test_the_same_key_and_body_replays_and_another_body_is_refused(
    spec: LoadedSpec, engine: Engine, tmp_path: Path
) -> None:
    async def scenario() -> tuple[ItemResult, ItemResult, AmountScoring]:
        fake = AmountScoring(ls=spec)
        scorer = await scorer_on(engine, tmp_path, fake, "a")
        first = await ask(scorer, "r1", "key-1", record(spec, "demo-1", 42.5))
        replay = await ask(scorer, "r2", "key-1", record(spec, "demo-1", 42.5))
        with pytest.raises(KeyReused, match="key-1"):
            await ask(scorer, "r3", "key-1", record(spec, "demo-1", 99.5))
        await settle(engine, scorer)
        return first, replay, fake

    first, replay, fake = asyncio.run(scenario())
    assert replay == first and first.request_id == "r1" and first.score == 0.0425
    assert getattr(first, spec.id.name) == "demo-1"
    assert fake.scored == [("demo-1", 42.5)], "neither the replay nor the refused body was scored"
    (stored,) = key_rows(engine)
    assert stored["idempotency_key"] == "key-1" and stored["request_id"] == "r1" and stored["response"]


def test_answered_keys_are_kept_as_their_answer_and_cost_the_collector_nothing(engine: Engine, tmp_path: Path) -> None:
    """After the answer, this process keeps a key as (fingerprint, answer JSON): the replay is the
    same answer, and 100,000 keys kept so are not walked by every full garbage collection."""

    async def scenario() -> tuple[list[ItemResult], list[ItemResult], list[object]]:
        scorer = await scorer_on(engine, tmp_path, AmountScoring(), "a")
        firsts = [await ask(scorer, f"r{i}", f"key-{i}", body(f"demo-{i}", 10.0 + i)) for i in range(3)]
        replays = [await ask(scorer, f"again-{i}", f"key-{i}", body(f"demo-{i}", 10.0 + i)) for i in range(3)]
        kept = list(scorer.keys._local.values())
        await settle(engine, scorer)
        return firsts, replays, kept

    firsts, replays, kept = asyncio.run(scenario())
    assert replays == firsts and [r.request_id for r in replays] == ["r0", "r1", "r2"]
    gc.collect()
    assert len(kept) == 3 and not any(gc.is_tracked(entry) for entry in kept)


def test_without_a_key_a_changed_body_is_scored_afresh(engine: Engine, tmp_path: Path) -> None:
    async def scenario() -> tuple[ItemResult, ItemResult]:
        scorer = await scorer_on(engine, tmp_path, AmountScoring(), "a")
        first = await ask(scorer, "r1", None, body("demo-1", 42.5))
        changed = await ask(scorer, "r2", None, body("demo-1", 9999.5))
        await settle(engine, scorer)
        return first, changed

    first, changed = asyncio.run(scenario())
    assert (first.score, first.request_id) == (0.0425, "r1")
    assert (changed.score, changed.request_id) == (9.9995, "r2")
    with engine.connect() as conn:
        stored = read_predictions(conn)
    assert sorted(stored["request_id"].to_list()) == ["r1", "r2"], "both answers the client received are kept"
    assert key_rows(engine) == []


def test_concurrent_identical_duplicates_without_a_key_are_scored_once(engine: Engine, tmp_path: Path) -> None:
    async def scenario() -> tuple[list[ItemResult], AmountScoring]:
        fake = AmountScoring(delay_s=0.05)
        scorer = await scorer_on(engine, tmp_path, fake, "a")
        answers = await asyncio.gather(*(ask(scorer, f"r{i}", None, body("tx-1", 5.0)) for i in range(20)))
        await settle(engine, scorer)
        return answers, fake

    answers, fake = asyncio.run(scenario())
    assert fake.scored == [("tx-1", 5.0)]
    assert all(answer == answers[0] for answer in answers)


def test_fifty_concurrent_duplicates_with_one_key_are_scored_once(engine: Engine, tmp_path: Path) -> None:
    async def scenario() -> tuple[list[ItemResult], ItemResult, AmountScoring]:
        fake = AmountScoring(delay_s=0.05)
        scorer = await scorer_on(engine, tmp_path, fake, "a")
        answers = await asyncio.gather(*(ask(scorer, f"r{i}", "key-1", body("tx-1", 5.0)) for i in range(DUPLICATES)))
        retry = await ask(scorer, "retry", "key-1", body("tx-1", 5.0))
        await settle(engine, scorer)
        return answers, retry, fake

    answers, retry, fake = asyncio.run(scenario())
    assert fake.scored == [("tx-1", 5.0)], "scored once"
    with engine.connect() as conn:
        stored = read_predictions(conn)
    as_json = [[answer.model_dump(mode="json")] for answer in answers]
    check_one_answer_per_key(as_json, [retry.model_dump(mode="json")], stored.to_dicts(), "key-1")


def test_two_processes_agree_through_the_store(engine: Engine, tmp_path: Path) -> None:
    async def scenario() -> tuple[ItemResult, ItemResult, AmountScoring]:
        fake_a, fake_b = AmountScoring(), AmountScoring()
        a = await scorer_on(engine, tmp_path, fake_a, "a")
        b = await scorer_on(engine, tmp_path, fake_b, "b")
        first = await ask(a, "r1", "key-1", body("demo-1", 42.5))
        await until_async(lambda: claimed(engine, "key-1", answered=True))  # a's answer reaches the store
        with pytest.raises(KeyReused):
            await ask(b, "r2", "key-1", body("demo-1", 9999.5))
        replay = await ask(b, "r3", "key-1", body("demo-1", 42.5))
        await settle(engine, a, b)
        return first, replay, fake_b

    first, replay, fake_b = asyncio.run(scenario())
    assert replay == first
    assert fake_b.scored == [], "the other process answered from the store"


def test_one_key_two_bodies_at_once_on_two_processes_gets_one_answer(engine: Engine, tmp_path: Path) -> None:
    async def scenario() -> list[ItemResult | BaseException]:
        a = await scorer_on(engine, tmp_path, AmountScoring(delay_s=0.05), "a")
        b = await scorer_on(engine, tmp_path, AmountScoring(delay_s=0.05), "b")
        outcomes = await asyncio.gather(
            ask(a, "ra", "key-1", body("demo-1", 1.0)),
            ask(b, "rb", "key-1", body("demo-1", 2.0)),
            return_exceptions=True,
        )
        await settle(engine, a, b)
        return outcomes

    outcomes = asyncio.run(scenario())
    answered = [o for o in outcomes if isinstance(o, ItemResult)]
    refused = [o for o in outcomes if isinstance(o, KeyReused)]
    assert len(answered) == 1 and len(refused) == 1, outcomes
    (stored,) = key_rows(engine)
    assert stored["request_id"] == answered[0].request_id


def test_the_same_key_and_body_on_another_process_waits_for_the_first_answer(engine: Engine, tmp_path: Path) -> None:
    async def scenario() -> tuple[ItemResult, ItemResult, AmountScoring]:
        fake_b = AmountScoring()
        a = await scorer_on(engine, tmp_path, AmountScoring(delay_s=0.3), "a")
        b = await scorer_on(engine, tmp_path, fake_b, "b")
        first_task = asyncio.create_task(ask(a, "r1", "key-1", body("demo-1", 3.0)))
        await until_async(lambda: claimed(engine, "key-1"))  # a holds the claim, still scoring (0.3 s)
        second = await ask(b, "r2", "key-1", body("demo-1", 3.0))
        first = await first_task
        await settle(engine, a, b)
        return first, second, fake_b

    first, second, fake_b = asyncio.run(scenario())
    assert second == first and fake_b.scored == []


def test_a_duplicate_still_in_progress_past_its_deadline_is_told_so(engine: Engine, tmp_path: Path) -> None:
    async def scenario() -> None:
        a = await scorer_on(engine, tmp_path, AmountScoring(delay_s=0.5), "a")
        b = await scorer_on(engine, tmp_path, AmountScoring(), "b")
        first_task = asyncio.create_task(ask(a, "r1", "key-1", body("demo-1", 3.0)))
        await until_async(lambda: claimed(engine, "key-1"))  # a holds the claim, scoring for 0.5 s
        with pytest.raises(KeyInProgress):
            await b.score(
                body("demo-1", 3.0), request_id="r2", idempotency_key="key-1", deadline=time.monotonic() + 0.1
            )
        await first_task
        await settle(engine, a, b)

    asyncio.run(scenario())


def test_a_duplicate_in_the_same_process_still_in_progress_past_its_deadline_is_told_so(
    engine: Engine, tmp_path: Path
) -> None:
    """It waits on the first request in-process; past its own deadline it was answered 504, as if
    its key were free, where the other process's duplicate was told 409 with Retry-After."""

    async def scenario() -> None:
        a = await scorer_on(engine, tmp_path, AmountScoring(delay_s=0.5), "a")
        first_task = asyncio.create_task(ask(a, "r1", "key-1", body("demo-1", 3.0)))
        await until_async(lambda: claimed(engine, "key-1"))  # the first holds the key, scoring for 0.5 s
        with pytest.raises(KeyInProgress):
            await a.score(
                body("demo-1", 3.0), request_id="r2", idempotency_key="key-1", deadline=time.monotonic() + 0.1
            )
        first = await first_task
        again = await a.score(
            body("demo-1", 3.0), request_id="r3", idempotency_key="key-1", deadline=time.monotonic() + 2
        )
        assert again[0] == [first], "the retry gets the first request's answer"
        await settle(engine, a)

    asyncio.run(scenario())


def test_a_keyed_answer_is_stored_before_the_client_has_it(engine: Engine, tmp_path: Path) -> None:
    """Stored after the answer, off the loop: a crash right after the 200 left the claim unanswered,
    and the retry once it went stale was scored afresh, another answer under one key."""

    async def scenario() -> None:
        a = await scorer_on(engine, tmp_path, AmountScoring(), "a")
        first = await ask(a, "r1", "key-1", body("demo-1", 3.0))
        assert claimed(engine, "key-1", answered=True), "no crash after the answer can lose it"
        (stored,) = key_rows(engine)
        assert stored["request_id"] == first.request_id
        await settle(engine, a)

    asyncio.run(scenario())


def test_a_refused_request_frees_its_key_for_the_retry(engine: Engine, tmp_path: Path) -> None:
    async def scenario() -> ItemResult:
        scoring = AmountScoring(delay_s=0.3)
        scorer = await scorer_on(engine, tmp_path, scoring, "a", p99_target_ms=1000)
        busy = asyncio.create_task(ask(scorer, "r0", None, body("busy", 1.0)))
        await until_async(lambda: scoring.started)  # the busy batch holds the scoring thread
        with pytest.raises((DeadlineExceeded, Shed)):
            await scorer.score(
                body("demo-1", 3.0), request_id="r1", idempotency_key="key-1", deadline=time.monotonic() + 0.05
            )
        await busy
        await until_async(lambda: not key_rows(engine))  # the refused request's claim is released
        retry = await ask(scorer, "r2", "key-1", body("demo-1", 3.0))
        await settle(engine, scorer)
        return retry

    retry = asyncio.run(scenario())
    assert retry.request_id == "r2" and retry.score == 0.003
    (stored,) = key_rows(engine)
    assert stored["request_id"] == "r2"


# ------------------------------------------------------------------ a duplicate whose first request got no answer
def test_a_duplicate_in_the_same_process_is_judged_on_its_own_deadline(engine: Engine, tmp_path: Path) -> None:
    """The first request under the key runs out of its short deadline; its duplicate, willing to
    wait five seconds, is admitted on its own and answered, as it would be on another process."""

    async def scenario() -> tuple[BaseException | tuple[list[ItemResult], float], ...]:
        scoring = AmountScoring(delay_s=0.3)
        scorer = await scorer_on(engine, tmp_path, scoring, "a", p99_target_ms=1000)
        busy = asyncio.create_task(ask(scorer, "r0", None, body("busy", 1.0)))
        await until_async(lambda: scoring.started)  # the scoring thread is busy for 0.3 s
        outcomes = await asyncio.gather(
            scorer.score(body("demo-1", 3.0), request_id="r1", idempotency_key="k", deadline=time.monotonic() + 0.1),
            scorer.score(body("demo-1", 3.0), request_id="r2", idempotency_key="k", deadline=time.monotonic() + 5),
            return_exceptions=True,
        )
        await busy
        await settle(engine, scorer)
        return tuple(outcomes)

    first, duplicate = asyncio.run(scenario())
    assert isinstance(first, DeadlineExceeded | Shed)
    assert not isinstance(duplicate, BaseException), f"the duplicate got {duplicate!r}"
    assert duplicate[0][0].score == 0.003
    (stored,) = key_rows(engine)
    assert stored["request_id"] == duplicate[0][0].request_id


def test_a_duplicate_of_a_request_refused_for_reusing_the_key_is_refused_at_once(
    engine: Engine, tmp_path: Path
) -> None:
    async def scenario() -> tuple[list[BaseException | tuple[list[ItemResult], float]], float]:
        a = await scorer_on(engine, tmp_path, AmountScoring(), "a")
        b = await scorer_on(engine, tmp_path, AmountScoring(), "b")
        await ask(a, "ra", "k", body("demo-1", 1.0))
        await until_async(lambda: claimed(engine, "k", answered=True))
        started = time.monotonic()
        outcomes = await asyncio.gather(
            b.score(body("demo-1", 2.0), request_id="rb1", idempotency_key="k", deadline=time.monotonic() + 5),
            b.score(body("demo-1", 2.0), request_id="rb2", idempotency_key="k", deadline=time.monotonic() + 5),
            return_exceptions=True,
        )
        elapsed = time.monotonic() - started
        await settle(engine, a, b)
        return outcomes, elapsed

    (first, duplicate), elapsed = asyncio.run(scenario())
    assert isinstance(first, KeyReused) and isinstance(duplicate, KeyReused)
    assert elapsed < 2, "the duplicate waited out its deadline for an answer that was never coming"


def test_a_duplicate_whose_first_request_waited_too_little_for_another_process_gets_the_answer(
    engine: Engine, tmp_path: Path
) -> None:
    async def scenario() -> tuple[ItemResult, BaseException | tuple[list[ItemResult], float], ...]:
        a = await scorer_on(engine, tmp_path, AmountScoring(delay_s=0.3), "a")
        b = await scorer_on(engine, tmp_path, AmountScoring(), "b")
        first_task = asyncio.create_task(ask(a, "ra", "k", body("demo-1", 3.0)))
        await until_async(lambda: claimed(engine, "k"))  # a holds the claim, scoring for 0.3 s
        outcomes = await asyncio.gather(
            b.score(body("demo-1", 3.0), request_id="rb1", idempotency_key="k", deadline=time.monotonic() + 0.1),
            b.score(body("demo-1", 3.0), request_id="rb2", idempotency_key="k", deadline=time.monotonic() + 2),
            return_exceptions=True,
        )
        first = await first_task
        await settle(engine, a, b)
        return (first, *outcomes)

    first, short, long = asyncio.run(scenario())
    assert isinstance(short, KeyInProgress)
    assert not isinstance(long, BaseException), f"the duplicate got {long!r}"
    assert long[0] == [first]


def test_a_duplicate_is_not_cancelled_with_the_request_it_waited_on(engine: Engine, tmp_path: Path) -> None:
    async def scenario() -> BaseException | tuple[list[ItemResult], float]:
        scoring = AmountScoring(delay_s=0.2)
        scorer = await scorer_on(engine, tmp_path, scoring, "a")
        owner = asyncio.create_task(ask(scorer, "r1", "k", body("demo-1", 3.0)))
        duplicate = asyncio.create_task(
            scorer.score(body("demo-1", 3.0), request_id="r2", idempotency_key="k", deadline=time.monotonic() + 5)
        )
        await until_async(lambda: scoring.started)  # the first request's item is being scored
        owner.cancel()  # its client went away
        (outcome,) = await asyncio.gather(duplicate, return_exceptions=True)
        await asyncio.gather(owner, return_exceptions=True)
        await settle(engine, scorer)
        return outcome

    outcome = asyncio.run(scenario())
    assert not isinstance(outcome, BaseException), f"the duplicate got {outcome!r}"
    assert outcome[0][0].score == 0.003


def test_a_request_cancelled_while_it_claims_its_key_leaves_no_claim_behind(engine: Engine, tmp_path: Path) -> None:
    """Cancelled while its claim's INSERT runs in a thread (its request ended, shutdown): the claim
    still lands, and is released, where every retry was told 409 until it went stale."""

    async def scenario() -> ItemResult:
        scorer = await scorer_on(engine, tmp_path, AmountScoring(), "a")
        first = asyncio.create_task(ask(scorer, "r1", "k", body("demo-1", 3.0)))
        await asyncio.sleep(0)  # the first request awaits its claim, in a thread
        first.cancel()
        with pytest.raises(asyncio.CancelledError):
            await first
        await until_async(lambda: not key_rows(engine))  # its claim landed, then was released
        retry = await ask(scorer, "r2", "k", body("demo-1", 3.0))
        await settle(engine, scorer)
        return retry

    assert asyncio.run(scenario()).request_id == "r2"


def test_an_outcome_the_store_did_not_take_is_written_with_the_next_one(engine: Engine) -> None:
    """The breaker was open when the first answer was to be stored: left unwritten, its claim stayed
    unanswered, and another process told every retry 409 until it went stale, then scored again."""
    breaker = CircuitBreaker(failure_threshold=1, reset_s=60.0)
    keys = IdempotencyKeys(engine, breaker, results=api_models(REFERENCE).results, size=100, stale_after_s=10.0)

    async def claim(key: str, request_id: str) -> None:
        admission = await keys.admit(key, f"body-{key}", request_id=request_id, deadline=time.monotonic() + 5)
        assert admission.claimed_in_store

    async def scenario() -> None:
        await claim("k1", "r1")
        await claim("k2", "r2")
        await claim("k3", "r3")

    asyncio.run(scenario())
    breaker.record_failure()  # an outage opens the breaker
    keys.store_outcome("k1", "r1", "[]")
    keys.store_outcome("k2", "r2", None)
    assert claimed(engine, "k1") and not claimed(engine, "k1", answered=True)
    assert claimed(engine, "k2")
    breaker.record_success()  # the store is back
    keys.store_outcome("k3", "r3", "[]")
    assert claimed(engine, "k1", answered=True) and claimed(engine, "k3", answered=True)
    assert not claimed(engine, "k2"), "the release is written too"


# ------------------------------------------------------------------ a store statement lost with its connection
@contextmanager
def failing(engine: Engine, statement: str, times: int) -> Iterator[list[str]]:
    """The next `times` statements on `engine` that begin with `statement` fail as on a connection
    the server terminated; yields those that failed."""
    failed: list[str] = []
    terminated = "terminating connection due to administrator command"

    def fail(conn: object, cursor: object, sql: str, params: Any, context: object, executemany: bool) -> None:
        if len(failed) < times and sql.lstrip().upper().startswith(statement):
            failed.append(sql)
            raise engine.dialect.loaded_dbapi.OperationalError(terminated)

    def dropped(context: sa.engine.ExceptionContext) -> None:
        # What the driver says of a connection pg_terminate_backend closed: SQLAlchemy invalidates it.
        if terminated in str(context.original_exception):
            context.is_disconnect = True

    sa.event.listen(engine, "before_cursor_execute", fail)
    sa.event.listen(engine, "handle_error", dropped)
    try:
        yield failed
    finally:
        sa.event.remove(engine, "before_cursor_execute", fail)
        sa.event.remove(engine, "handle_error", dropped)


def test_a_full_answer_whose_claim_never_reached_the_store_is_the_one_the_key_replays(
    engine: Engine, tmp_path: Path
) -> None:
    """The claim's INSERT failed once: the full answer was given unstored, and after a restart (or on
    another replica) the same key and body got another answer, a second row under one key."""

    async def scenario() -> tuple[ItemResult, ItemResult]:
        a = await scorer_on(engine, tmp_path, AmountScoring(), "a")
        with failing(engine, "INSERT INTO IDEMPOTENCY_KEYS", times=1) as failed:
            first = await ask(a, "r1", "key-1", body("demo-1", 3.0))
        assert failed, "the claim failed"
        await settle(engine, a)
        b = await scorer_on(engine, tmp_path, AmountScoring(), "b")  # a restart, or another replica
        again = await ask(b, "r2", "key-1", body("demo-1", 3.0))
        await settle(engine, b)
        return first, again

    first, again = asyncio.run(scenario())
    assert first.request_id == "r1" and again == first
    (stored,) = key_rows(engine)
    assert stored["request_id"] == "r1"


def test_an_answer_whose_store_failed_once_is_stored_on_a_fresh_connection(engine: Engine, tmp_path: Path) -> None:
    async def scenario() -> tuple[ItemResult, ItemResult]:
        a = await scorer_on(engine, tmp_path, AmountScoring(), "a")
        with failing(engine, "UPDATE IDEMPOTENCY_KEYS", times=1) as failed:
            first = await ask(a, "r1", "key-1", body("demo-1", 3.0))
        assert failed, "the answer's first write failed"
        assert claimed(engine, "key-1", answered=True), "stored before the client had it"
        await settle(engine, a)
        b = await scorer_on(engine, tmp_path, AmountScoring(), "b")
        again = await ask(b, "r2", "key-1", body("demo-1", 3.0))
        await settle(engine, b)
        return first, again

    first, again = asyncio.run(scenario())
    assert first.request_id == "r1" and again == first


def test_a_full_answer_the_store_did_not_take_is_refused_for_a_retry(engine: Engine, tmp_path: Path) -> None:
    """Given unstored, a replica would have replayed another answer under the key: refused with
    Retry-After instead, its claim freed, and the retry's answer is the one the key keeps."""

    async def scenario() -> tuple[Refused, ItemResult, ItemResult]:
        a = await scorer_on(engine, tmp_path, AmountScoring(), "a", breaker_failure_threshold=5)
        with failing(engine, "UPDATE IDEMPOTENCY_KEYS", times=2), pytest.raises(Refused) as refused:
            await ask(a, "r1", "key-1", body("demo-1", 3.0))
        await until_async(lambda: not key_rows(engine))  # the claim is freed for the retry
        retry = await ask(a, "r2", "key-1", body("demo-1", 3.0))
        b = await scorer_on(engine, tmp_path, AmountScoring(), "b")
        again = await ask(b, "r3", "key-1", body("demo-1", 3.0))
        await settle(engine, a, b)
        return refused.value, retry, again

    refused, retry, again = asyncio.run(scenario())
    assert (refused.status, refused.error, refused.headers) == (503, "store_unavailable", {"Retry-After": "1"})
    assert retry.request_id == "r2" and again == retry
