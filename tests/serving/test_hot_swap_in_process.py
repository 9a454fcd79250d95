"""Model promotion without a restart, in-process.

Hand-written fakes for the scoring step of each version (a thread pool each): the swap waits for
warm-up, a failed version never serves, a batch already on the old pool finishes there, polling
follows promotion and rollback; and discarding a pool stops a process stuck in its load. The same
moves against a real `bentoml serve` under load are test_hot_swap_live.py.
"""

from __future__ import annotations

import asyncio
import math
import multiprocessing
import threading
import time
from collections.abc import Awaitable
from concurrent.futures import CancelledError, ThreadPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path
from typing import TypeVar

import psutil
import pytest
from sqlalchemy.engine import Engine

from inference.store import read_predictions, utc_now
from serving.backends import ScoringBackend
from serving.lifecycle import ModelWatcher
from serving.metrics import ServingMetrics
from serving.outbox import Outbox
from serving.runtime import OnlineScorer
from serving.schemas import ItemError
from serving.scoring import BatchResult, ItemSpec
from serving.scoring_process import ScoringProcess, terminate
from serving.settings import ServingSettings
from tests.reference import REFERENCE, ItemResult
from tests.serving.support import FakeClock, scored_batch, transaction
from tests.shared import WAIT_S, until_async

CODE = "test"
T = TypeVar("T")


class FakeVersion:
    """One model version's scoring step: every item scores `score`, stamped with the version.

    `warm_up_gate` holds warm-up batches and `release` holds real ones, so a test can keep either
    in flight; `nonfinite` answers NaN as an error, as corrupt weights would.
    """

    def __init__(self, version: str, score: float, *, nonfinite: bool = False) -> None:
        self.version = version
        self.score = score
        self.nonfinite = nonfinite
        self.batches: list[list[str]] = []
        self.warm_up_gate = threading.Event()
        self.warm_up_gate.set()
        self.release = threading.Event()
        self.release.set()
        self.entered = threading.Event()  # a real (not warm-up) batch has started

    def __call__(self, specs: list[ItemSpec]) -> BatchResult:
        ids = [spec.record_id for spec in specs]
        self.batches.append(ids)
        if all(tx.startswith("warm-up-") for tx in ids):
            self.warm_up_gate.wait(WAIT_S)
        else:
            self.entered.set()
            self.release.wait(WAIT_S)
        if self.nonfinite:
            now = utc_now()
            failed = ItemError(reason="nonfinite_score", detail="score is NaN")
            return BatchResult(
                results=[
                    ItemResult(
                        transaction_id=tx,
                        status="error",
                        model_version=self.version,
                        path="online",
                        request_id=spec.request_id,
                        produced_at=now,
                        error=failed,
                    )
                    for tx, spec in zip(ids, specs, strict=True)
                ]
            )
        return scored_batch(specs, model_version=self.version, score=self.score, batch_id=f"batch-{self.version}")

    @property
    def real_batches(self) -> list[list[str]]:
        return [batch for batch in self.batches if not batch[0].startswith("warm-up-")]


class RecordingPool(ThreadPoolExecutor):
    """A pool that records its shutdown; with `exit_gate` set, its shutdown waits for the gate, as
    a scoring process slow to exit would."""

    def __init__(self) -> None:
        super().__init__(max_workers=1)
        self.shut_down = False
        self.exited = False
        self.exit_gate: threading.Event | None = None

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        self.shut_down = True
        if self.exit_gate is not None:
            self.exit_gate.wait(WAIT_S)
        super().shutdown(wait, cancel_futures=cancel_futures)
        self.exited = True


class FakeStore:
    """The model store and its production pointer, as the watcher sees them."""

    def __init__(self, *versions: FakeVersion) -> None:
        self.versions = {v.version: v for v in versions}
        self.pointer: str | None = None
        self.pointer_reads = 0
        self.pools: dict[str, list[RecordingPool]] = {}

    def production_tag(self) -> str | None:
        self.pointer_reads += 1
        return self.pointer

    def load(self, tag: str) -> ScoringBackend:
        if tag not in self.versions:
            raise LookupError(f"no model {tag!r} in the store")
        pool = RecordingPool()
        self.pools.setdefault(tag, []).append(pool)
        return ScoringBackend(tag, pool, self.versions[tag])


async def serving(store: FakeStore, engine: Engine, tmp_path: Path) -> OnlineScorer:
    """A started scorer on v1, warmed up through its fake like the service does."""
    first = store.load("v1")
    scorer = OnlineScorer(
        spec=REFERENCE,
        process=first.process,
        executor=first.executor,
        model_version=first.model_version,
        engine=engine,
        settings=ServingSettings(max_batch_size=8),
        outbox=Outbox(tmp_path / "outbox.sqlite3"),
        metrics=ServingMetrics(code_version=CODE),
    )
    await asyncio.to_thread(scorer.warm_up)
    await scorer.start()
    return scorer


def watcher_for(scorer: OnlineScorer, store: FakeStore, clock: FakeClock, **overrides: float) -> ModelWatcher:
    options: dict[str, float] = {"interval_s": 0.02, "load_timeout_s": 5.0, "retry_max_s": 1.0, **overrides}
    return ModelWatcher(
        scorer,
        production_tag=store.production_tag,
        load=store.load,
        discard=terminate,
        clock=clock,
        **options,
    )


async def score(scorer: OnlineScorer, tx: str) -> ItemResult:
    results, _ = await scorer.score(
        [transaction(tx)], request_id=f"r-{tx}", idempotency_key=None, deadline=time.monotonic() + WAIT_S
    )
    return results[0]


async def bounded(awaitable: Awaitable[T]) -> T:
    """A swap that never happens fails the test instead of hanging it."""
    return await asyncio.wait_for(awaitable, WAIT_S)


def info(scorer: OnlineScorer, version: str) -> float | None:
    labels = {"model_version": version, "code_version": CODE}
    return scorer.metrics.registry.get_sample_value("tandem_serving_model_info", labels)


def swaps(scorer: OnlineScorer, outcome: str) -> float | None:
    return scorer.metrics.registry.get_sample_value("tandem_serving_model_swaps_total", {"outcome": outcome})


def test_the_swap_happens_only_after_the_new_version_is_warm(sqlite_engine: Engine, tmp_path: Path) -> None:
    v1, v2 = FakeVersion("v1", 0.25), FakeVersion("v2", 0.75)
    store = FakeStore(v1, v2)

    async def scenario() -> None:
        scorer = await serving(store, sqlite_engine, tmp_path)
        watcher = watcher_for(scorer, store, FakeClock(1000.0))
        cost = scorer.cost
        assert info(scorer, "v1") == 1
        v2.warm_up_gate.clear()
        swapping = asyncio.create_task(watcher.swap_to("v2"))
        await until_async(lambda: bool(v2.batches))

        during = await score(scorer, "during-warm-up")
        assert (during.model_version, during.score) == ("v1", 0.25)
        assert scorer.model_version == "v1"
        assert info(scorer, "v2") is None

        v2.warm_up_gate.set()
        assert await bounded(swapping) == "succeeded"
        after = await score(scorer, "after-swap")
        assert (after.model_version, after.score) == ("v2", 0.75)
        # Every warm-up batch (1 lazy-init call + 3 rounds of sizes 1 and 8) ran before real traffic.
        assert [len(batch) for batch in v2.batches] == [1, 1, 8, 1, 8, 1, 8, 1]
        assert v2.real_batches == [["after-swap"]]
        assert store.pools["v1"][0].shut_down
        assert not store.pools["v2"][0].shut_down
        assert (info(scorer, "v1"), info(scorer, "v2")) == (0, 1)
        assert (swaps(scorer, "succeeded"), swaps(scorer, "failed")) == (1, 0)
        assert scorer.cost is cost and scorer.batcher is not None and scorer.batcher.cost is cost, "cost carries over"
        await scorer.close()
        scorer.executor.shutdown()

    asyncio.run(scenario())


@pytest.mark.parametrize("failure", ["nonfinite_scores", "missing_from_store", "hangs_in_warm_up"])
def test_a_version_that_fails_to_warm_up_never_serves_and_is_retried_later(
    failure: str, sqlite_engine: Engine, tmp_path: Path
) -> None:
    v1, v2 = FakeVersion("v1", 0.25), FakeVersion("v2", 0.75, nonfinite=failure == "nonfinite_scores")
    store = FakeStore(v1) if failure == "missing_from_store" else FakeStore(v1, v2)
    clock = FakeClock(1000.0)

    async def scenario() -> None:
        scorer = await serving(store, sqlite_engine, tmp_path)
        watcher = watcher_for(scorer, store, clock, load_timeout_s=0.3)
        if failure == "hangs_in_warm_up":
            v2.warm_up_gate.clear()
        store.pointer = "v2"
        assert await bounded(watcher.poll_once()) == "failed"
        served = await score(scorer, "after-failure")
        assert (served.model_version, served.score) == ("v1", 0.25)
        assert scorer.model_version == "v1"
        assert all(pool.shut_down for pool in store.pools.get("v2", [])), "the failed pool is discarded"
        assert not store.pools["v1"][0].shut_down
        assert (info(scorer, "v1"), info(scorer, "v2")) == (1, None)
        assert (swaps(scorer, "succeeded"), swaps(scorer, "failed")) == (0, 1)

        # Backing off: the next poll, too soon, does not try again.
        assert await bounded(watcher.poll_once()) is None
        # The version is fixed (or appears in the store); a later poll takes it.
        v2.nonfinite = False
        v2.warm_up_gate.set()
        store.versions["v2"] = v2
        clock.now += 0.05
        assert await bounded(watcher.poll_once()) == "succeeded"
        assert (await score(scorer, "after-retry")).model_version == "v2"
        assert (swaps(scorer, "succeeded"), swaps(scorer, "failed")) == (1, 1)
        await scorer.close()
        scorer.executor.shutdown()

    asyncio.run(scenario())


def test_a_batch_in_flight_on_the_old_pool_completes_there(sqlite_engine: Engine, tmp_path: Path) -> None:
    v1, v2 = FakeVersion("v1", 0.25), FakeVersion("v2", 0.75)
    store = FakeStore(v1, v2)

    async def scenario() -> tuple[ItemResult, ItemResult]:
        scorer = await serving(store, sqlite_engine, tmp_path)
        watcher = watcher_for(scorer, store, FakeClock(1000.0))
        v1.release.clear()
        in_flight = asyncio.create_task(score(scorer, "in-flight"))
        await until_async(v1.entered.is_set)

        swapping = asyncio.create_task(watcher.swap_to("v2"))
        await until_async(lambda: len(v2.batches) == 7)  # warm-up done: 1 lazy-init call + 3 rounds of 2
        await asyncio.sleep(0.05)  # room for the swap to finish wrongly before the running batch
        assert not swapping.done(), "the swap waits for the running batch"
        assert scorer.model_version == "v1"
        assert not store.pools["v1"][0].shut_down
        # Admitted under v1, it runs after the swap: v2 answers it and its row names v2.
        queued = asyncio.create_task(score(scorer, "queued"))
        await asyncio.sleep(0.02)  # room for it to be answered wrongly before the swap
        assert not queued.done()

        v1.release.set()
        first, second = await bounded(in_flight), await bounded(queued)
        assert await bounded(swapping) == "succeeded"
        assert v1.real_batches == [["in-flight"]]
        assert v2.real_batches == [["queued"]]
        assert store.pools["v1"][0].shut_down
        scorer.writer.flush()
        await scorer.close()
        scorer.executor.shutdown()
        return first, second

    first, second = asyncio.run(scenario())
    assert (first.model_version, first.score) == ("v1", 0.25)
    assert (second.model_version, second.score) == ("v2", 0.75)
    with sqlite_engine.connect() as conn:
        stored = read_predictions(conn).sort("record_id")
    assert stored.select("record_id", "model_version", "path").rows() == [
        ("in-flight", "v1", "online"),
        ("queued", "v2", "online"),
    ]


def test_polling_follows_promotion_and_rollback(sqlite_engine: Engine, tmp_path: Path) -> None:
    v1, v2 = FakeVersion("v1", 0.25), FakeVersion("v2", 0.75)
    store = FakeStore(v1, v2)
    store.pointer = "v1"

    async def scenario() -> None:
        scorer = await serving(store, sqlite_engine, tmp_path)
        watcher = watcher_for(scorer, store, FakeClock(1000.0))
        watcher.start()
        await until_async(lambda: store.pointer_reads >= 5)
        assert store.pools.keys() == {"v1"}, "an unchanged pointer loads nothing"
        store.pointer = "v2"
        await until_async(lambda: scorer.model_version == "v2")
        assert (await score(scorer, "promoted")).model_version == "v2"
        store.pointer = "v1"
        await until_async(lambda: scorer.model_version == "v1")
        assert (await score(scorer, "rolled-back")).score == 0.25
        await watcher.close()
        assert [pool.shut_down for pool in (*store.pools["v1"], *store.pools["v2"])] == [True, False, True]
        assert (info(scorer, "v1"), info(scorer, "v2")) == (1, 0)
        await scorer.close()
        scorer.executor.shutdown()

    asyncio.run(scenario())


def test_closing_mid_swap_returns_only_once_the_old_pool_has_exited(sqlite_engine: Engine, tmp_path: Path) -> None:
    v1, v2 = FakeVersion("v1", 0.25), FakeVersion("v2", 0.75)
    store = FakeStore(v1, v2)
    store.pointer = "v1"
    slow_exit = threading.Event()

    async def scenario() -> None:
        scorer = await serving(store, sqlite_engine, tmp_path)
        old_pool = store.pools["v1"][0]
        old_pool.exit_gate = slow_exit
        watcher = watcher_for(scorer, store, FakeClock(1000.0))
        watcher.start()
        store.pointer = "v2"
        await until_async(lambda: old_pool.shut_down)
        closing = asyncio.create_task(watcher.close())
        await asyncio.sleep(0.05)  # room for the close to return before the old pool has exited
        assert not closing.done(), "the close waits for the old pool's process"
        slow_exit.set()
        await bounded(closing)
        assert old_pool.exited
        assert scorer.model_version == "v2"
        await scorer.close()
        scorer.executor.shutdown()

    try:
        asyncio.run(scenario())
    finally:
        slow_exit.set()


def _running(pid: int | None) -> bool:
    try:
        return pid is not None and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_discarding_a_pool_stops_a_process_stuck_in_its_load() -> None:
    pool = ScoringProcess(multiprocessing.get_context("spawn"), initializer=time.sleep, initargs=(600,))
    pending = pool.submit(math.sqrt, 4.0)
    processes = [pool.process]
    assert processes and all(process.is_alive() for process in processes)
    started = time.monotonic()
    terminate(pool)
    assert time.monotonic() - started < 12
    # By pid, not is_alive(): a process reaped elsewhere still says is_alive() True.
    assert not any(_running(process.pid) for process in processes)
    # Cancelled if the pool had not yet handed it to the process, else failed with the process.
    with pytest.raises((BrokenProcessPool, CancelledError)):
        pending.result(timeout=5)
