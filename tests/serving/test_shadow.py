"""Shadow scoring in-process: the challenger sees a deterministic sample of what the champion
answered, after it answered; its answers land in challenger_predictions (path=shadow) and nowhere
a client can see; under load, with a full queue, a slow or a dead challenger, shadow work is
dropped and counted while the champion's answers stay exactly what they are without a shadow.

Hand-written scoring steps on thread pools stand in for the two versions' processes (as in
test_hot_swap_in_process.py); the live service with real models is
tests/scenario/test_challenger_rollout.py.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import threading
import uuid
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import Engine

from inference.store import challenger_predictions, predictions, read_predictions
from serving.backends import ScoringBackend
from serving.lifecycle import ChallengerWatcher
from serving.metrics import ServingMetrics
from serving.runtime import OnlineScorer
from serving.scoring import BatchResult, ItemSpec
from serving.scoring_process import ScoringProcess
from serving.settings import ServingSettings
from serving.shadow import ShadowLimits, ShadowScorer, sampled
from tests.reference import REFERENCE
from tests.serving.support import scored_batch, started_scorer, transaction
from tests.shared import until_async

CHAMPION, CHALLENGER = "risk_model:champion", "risk_model:challenger"


def champion_step(specs: list[ItemSpec]) -> BatchResult:
    return scored_batch(specs, model_version=CHAMPION, batch_id=uuid.uuid4().hex, score=0.25)


class ChallengerStep:
    """The challenger's scoring step: scores 0.75, and can be held (`gate`) or made to fail."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.gate.set()
        self.seen: list[str] = []
        self.batch_sizes: list[int] = []
        self.fail = False

    def __call__(self, specs: list[ItemSpec]) -> BatchResult:
        assert self.gate.wait(30), "a test left the challenger held"
        if self.fail:
            raise RuntimeError("challenger weights are corrupt")
        self.seen.extend(str(spec.raw["transaction_id"]) for spec in specs)
        self.batch_sizes.append(len(specs))
        return scored_batch(specs, model_version=CHALLENGER, batch_id=uuid.uuid4().hex, score=0.75)


class Champion:
    """The champion's load as the shadow reads it. The shadow asks whether it is busy only once
    its batch has lingered long enough, so `asked_busy` counts the passes it waited for the
    champion alone."""

    def __init__(self) -> None:
        self.queued = 0  # items waiting for the champion's next batch
        self.in_flight = False  # a champion batch running
        self.asked_busy = 0

    def queued_items(self) -> int:
        return self.queued

    def busy(self) -> bool:
        self.asked_busy += 1
        return self.in_flight or self.queued > 0


def metric(metrics: ServingMetrics, name: str, **labels: str) -> float:
    value = metrics.registry.get_sample_value(name, labels)
    return 0.0 if value is None else value


def shadow_rows(engine: Engine) -> list[dict[str, Any]]:
    with engine.connect() as conn:
        rows = conn.execute(sa.select(challenger_predictions).order_by(challenger_predictions.c.record_id))
        return [dict(row._mapping) for row in rows]


def ids_sampled(share: float, count: int, prefix: str = "tx") -> list[str]:
    """`count` transaction ids the sample at `share` picks."""
    found: list[str] = []
    index = 0
    while len(found) < count:
        candidate = f"{prefix}-{index}"
        if sampled(candidate, share):
            found.append(candidate)
        index += 1
    return found


async def score(scorer: OnlineScorer, ids: list[str], request_id: str = "req") -> list[float | None]:
    loop = asyncio.get_running_loop()
    results, _ = await scorer.score(
        [transaction(tx) for tx in ids], request_id=request_id, idempotency_key=None, deadline=loop.time() + 10
    )
    return [result.score for result in results]


def with_scorer(
    engine: Engine,
    tmp_path: Path,
    body: Callable[[OnlineScorer], Awaitable[None]],
    limits: ShadowLimits | None = None,
    **overrides: Any,
) -> None:
    """Run `body` against a started champion scorer (sampling half the items unless overridden),
    its shadow queue bounded by `limits` (the defaults unless given)."""

    async def scenario() -> None:
        scorer = await started_scorer(
            champion_step,
            engine,
            tmp_path / "outbox.sqlite3",
            model_version=CHAMPION,
            **{"shadow_sample": 0.5, **overrides},
        )
        if limits is not None:
            scorer.shadow.limits = limits
        try:
            await body(scorer)
        finally:
            await scorer.close()
            scorer.executor.shutdown(wait=True)

    asyncio.run(scenario())


def install(scorer: OnlineScorer, step: Callable[[list[ItemSpec]], BatchResult]) -> ThreadPoolExecutor:
    pool = ThreadPoolExecutor(max_workers=1)
    scorer.shadow.set_backend(ScoringBackend(CHALLENGER, pool, step))
    return pool


def test_the_sample_is_a_stable_share_of_transaction_ids() -> None:
    ids = [f"tx-{i}" for i in range(20_000)]
    share = sum(sampled(tx, 0.1) for tx in ids) / len(ids)
    assert 0.09 < share < 0.11, share
    assert [sampled(tx, 0.1) for tx in ids[:500]] == [sampled(tx, 0.1) for tx in ids[:500]], "a retry is sampled alike"
    assert not any(sampled(tx, 0.0) for tx in ids) and all(sampled(tx, 1.0) for tx in ids)


def test_the_challenger_scores_the_sample_and_the_client_gets_the_champion(
    sqlite_engine: Engine, tmp_path: Path
) -> None:
    async def body(scorer: OnlineScorer) -> None:
        install(scorer, ChallengerStep())
        chosen = ids_sampled(0.5, 6)
        others = [tx for tx in (f"other-{i}" for i in range(40)) if not sampled(tx, 0.5)][:6]
        assert await score(scorer, chosen + others) == [0.25] * 12, "every answer is the champion's"

        await until_async(
            lambda: len(shadow_rows(sqlite_engine)) == len(chosen),
            message=lambda: f"shadow rows: {shadow_rows(sqlite_engine)}",
        )
        rows = shadow_rows(sqlite_engine)
        assert sorted(row["record_id"] for row in rows) == sorted(chosen), "exactly the sampled ones"
        assert {row["path"] for row in rows} == {"shadow"} and {row["model_version"] for row in rows} == {CHALLENGER}
        assert all(row["score"] == 0.75 and row["request_id"] == "req" for row in rows)
        assert all(row["latency_ms"] is not None and row["latency_ms"] >= 0 for row in rows)
        # Counted once the write's transaction is over, a moment after its rows are visible.
        await until_async(lambda: metric(scorer.metrics, "tandem_shadow_items_total", outcome="scored") == len(chosen))
        assert metric(scorer.metrics, "tandem_shadow_model_info", model_version=CHALLENGER) == 1

    with_scorer(sqlite_engine, tmp_path, body)
    # Nothing of the challenger's reaches the table clients' answers (and replays) are read from.
    with sqlite_engine.connect() as conn:
        stored = read_predictions(conn)
    assert stored.height == 12
    assert set(stored["model_version"]) == {CHAMPION} and set(stored["path"]) == {"online"}


def test_without_a_challenger_nothing_is_shadowed(sqlite_engine: Engine, tmp_path: Path) -> None:
    async def body(scorer: OnlineScorer) -> None:
        assert await score(scorer, ids_sampled(0.5, 4)) == [0.25] * 4
        # The batch hook ran before the answers came back: had anything been offered, it would show.
        assert len(scorer.shadow._queue) == 0
        assert metric(scorer.metrics, "tandem_shadow_items_total", outcome="dropped") == 0

    with_scorer(sqlite_engine, tmp_path, body)
    assert shadow_rows(sqlite_engine) == []


def test_a_failing_challenger_is_counted_and_changes_no_answer(sqlite_engine: Engine, tmp_path: Path) -> None:
    async def body(scorer: OnlineScorer) -> None:
        step = ChallengerStep()
        step.fail = True
        install(scorer, step)
        assert await score(scorer, ids_sampled(0.5, 4)) == [0.25] * 4
        await until_async(lambda: metric(scorer.metrics, "tandem_shadow_dropped_total", reason="scoring_failed") == 4)
        assert await score(scorer, ids_sampled(0.5, 2, prefix="after")) == [0.25] * 2, "the champion serves on"

    with_scorer(sqlite_engine, tmp_path, body)
    assert shadow_rows(sqlite_engine) == []


def test_a_dead_challenger_process_is_let_go(sqlite_engine: Engine, tmp_path: Path) -> None:
    async def body(scorer: OnlineScorer) -> None:
        pool = ScoringProcess(multiprocessing.get_context("forkserver"))
        pool.submit(abs, 1).result()  # its process is up
        pool.process.kill()
        pool.process.join()
        scorer.shadow.set_backend(ScoringBackend(CHALLENGER, pool, champion_step))
        assert await score(scorer, ids_sampled(0.5, 2)) == [0.25] * 2
        await until_async(lambda: scorer.shadow.backend is None)
        assert metric(scorer.metrics, "tandem_shadow_dropped_total", reason="scoring_failed") == 2

    with_scorer(sqlite_engine, tmp_path, body)


def test_a_slow_challenger_fills_its_queue_and_drops_the_rest(sqlite_engine: Engine, tmp_path: Path) -> None:
    step = ChallengerStep()

    async def body(scorer: OnlineScorer) -> None:
        step.gate.clear()
        install(scorer, step)
        answers = await asyncio.wait_for(score(scorer, [f"q-{i}" for i in range(10)]), timeout=5)
        assert answers == [0.25] * 10, "a held challenger delays no answer"
        # One champion batch of ten offered at once: four fit the queue, six are dropped at the bound.
        assert metric(scorer.metrics, "tandem_shadow_dropped_total", reason="queue_full") == 6
        step.gate.set()

        def settled() -> bool:
            scored = metric(scorer.metrics, "tandem_shadow_items_total", outcome="scored")
            return scored + metric(scorer.metrics, "tandem_shadow_items_total", outcome="dropped") == 10

        await until_async(settled)

    try:
        limits = ShadowLimits(queue_capacity=4, max_batch=2)
        with_scorer(sqlite_engine, tmp_path, body, limits, shadow_sample=1.0)
    finally:
        step.gate.set()
    assert len(shadow_rows(sqlite_engine)) == 4 == len(step.seen)


def test_an_overloaded_champion_drops_shadow_work_first(sqlite_engine: Engine) -> None:
    """Offers while the champion has more queued than a batch takes are dropped at once; queued
    ones age out while it stays busy. No event loop work beyond the offer itself."""
    champion = Champion()
    clock = {"now": 100.0}
    metrics = ServingMetrics()
    shadow = ShadowScorer(
        spec=REFERENCE,
        engine=sqlite_engine,
        settings=ServingSettings(shadow_sample=1.0, max_batch_size=8),
        metrics=metrics,
        champion_queued=champion.queued_items,
        champion_busy=champion.busy,
        clock=lambda: clock["now"],
        limits=ShadowLimits(linger_s=0.1, max_age_s=0.5),
    )

    async def scenario() -> None:
        shadow.set_backend(ScoringBackend(CHALLENGER, ThreadPoolExecutor(max_workers=1), ChallengerStep()))
        specs = [ItemSpec(raw=transaction(f"o-{i}").to_raw(), record_id=f"o-{i}", request_id="r") for i in range(3)]
        champion.queued = 8
        shadow.offer(specs, champion_step(specs))
        assert metric(metrics, "tandem_shadow_dropped_total", reason="overload") == 3
        champion.queued = 3  # busy, but within a batch: queued, waiting for the champion to be idle
        shadow.offer(specs, champion_step(specs))
        shadow.start()
        clock["now"] += 0.2  # past the linger, within the age limit: only the champion holds it back
        await until_async(lambda: champion.asked_busy >= 3)
        assert metric(metrics, "tandem_shadow_items_total", outcome="scored") == 0, "not while the champion has work"
        clock["now"] += 1.0
        await until_async(lambda: metric(metrics, "tandem_shadow_dropped_total", reason="stale") == 3)
        degraded = champion_step(specs)
        degraded.degraded = True
        champion.queued = 0
        shadow.offer(specs, degraded)
        assert len(shadow._queue) == 0, "a degraded batch is not shadowed"
        await shadow.close()

    asyncio.run(scenario())


def test_the_watcher_follows_the_challenger_pointer(sqlite_engine: Engine, tmp_path: Path) -> None:
    pointer: dict[str, str | None] = {"tag": None}
    loads: list[str] = []

    def load(tag: str) -> ScoringBackend:
        loads.append(tag)
        if tag == "risk_model:broken":
            raise RuntimeError("cannot load")
        return ScoringBackend(tag, ThreadPoolExecutor(max_workers=1), ChallengerStep())

    async def body(scorer: OnlineScorer) -> None:
        watcher = ChallengerWatcher(
            scorer.shadow,
            challenger_tag=lambda: pointer["tag"],
            load=load,
            interval_s=60,
            load_timeout_s=10,
            retry_max_s=60,
        )
        assert await watcher.poll_once() is None and scorer.shadow.backend is None
        pointer["tag"] = CHALLENGER
        assert await watcher.poll_once() == "started" and scorer.shadow.model_version == CHALLENGER
        assert await watcher.poll_once() is None, "unchanged"
        pointer["tag"] = "risk_model:broken"
        assert await watcher.poll_once() == "failed"
        assert scorer.shadow.model_version == CHALLENGER, "a challenger that cannot load leaves the old one"
        assert await watcher.poll_once() is None and loads.count("risk_model:broken") == 1, "backed off"
        pointer["tag"] = None
        assert await watcher.poll_once() == "stopped" and scorer.shadow.backend is None
        assert metric(scorer.metrics, "tandem_shadow_model_info", model_version=CHALLENGER) == 0
        await watcher.close()

    with_scorer(sqlite_engine, tmp_path, body)


def test_shadow_rows_never_reach_predictions(sqlite_engine: Engine) -> None:
    """The table split the design relies on: a shadow row in predictions is refused by the schema."""
    row = {
        **scored_batch(
            [ItemSpec(raw=transaction("x").to_raw(), record_id="x", request_id="r")],
            model_version=CHALLENGER,
            batch_id="b",
        ).rows[0],
        "path": "shadow",
        "answer_key": "h|nohistory",
    }
    with pytest.raises(sa.exc.IntegrityError), sqlite_engine.begin() as conn:
        conn.execute(sa.insert(predictions).values(**row))


def test_samples_gather_into_one_challenger_batch_while_the_champion_is_idle(sqlite_engine: Engine) -> None:
    """Three champion batches' samples within the linger are one challenger batch, started only
    once the champion has no batch in flight."""
    champion = Champion()
    clock = {"now": 100.0}
    metrics = ServingMetrics()
    step = ChallengerStep()
    shadow = ShadowScorer(
        spec=REFERENCE,
        engine=sqlite_engine,
        settings=ServingSettings(shadow_sample=1.0),
        metrics=metrics,
        champion_queued=champion.queued_items,
        champion_busy=champion.busy,
        clock=lambda: clock["now"],
        limits=ShadowLimits(linger_s=0.2, max_batch=8),
    )

    async def scenario() -> None:
        shadow.set_backend(ScoringBackend(CHALLENGER, ThreadPoolExecutor(max_workers=1), step))
        shadow.start()
        for batch in range(3):
            specs = [ItemSpec(raw=transaction(f"g-{batch}").to_raw(), record_id=f"g-{batch}", request_id="r")]
            shadow.offer(specs, champion_step(specs))
        champion.in_flight = True  # a champion batch in flight past the linger: the shadow waits
        clock["now"] += 0.3
        await until_async(lambda: champion.asked_busy >= 3)
        assert step.batch_sizes == []
        champion.in_flight = False
        await until_async(lambda: metric(metrics, "tandem_shadow_items_total", outcome="scored") == 3)
        await shadow.close()

    asyncio.run(scenario())
    assert step.batch_sizes == [3]
