"""The pool supervisor in-process: a scoring process that dies while the service is idle is noticed
by the supervisor's own tick, and a replacement brought up while a promotion happens gives way to
the promoted version. The hot swap fakes are test_hot_swap_in_process.py's."""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from sqlalchemy.engine import Engine

from serving.backends import ScoringBackend
from serving.batcher import SCORING_PROCESS_DIED
from serving.lifecycle import PoolSupervisor
from serving.runtime import OnlineScorer
from serving.schemas import ItemResult
from serving.scoring_process import ScoringProcess, terminate
from tests.serving.support import FakeClock, score_or_hang, started_scorer, transaction
from tests.serving.test_hot_swap_in_process import FakeStore, FakeVersion, bounded, score, serving, watcher_for
from tests.serving.test_runtime import DeadPool
from tests.shared import WAIT_S, until_async

MODEL = "risk_model:fake"  # the version score_or_hang stamps


async def scored(scorer: OnlineScorer, tx: str) -> ItemResult:
    results, _ = await scorer.score(
        [transaction(tx)], request_id=f"r-{tx}", idempotency_key=None, deadline=time.monotonic() + WAIT_S
    )
    return results[0]


def test_a_scoring_process_that_exits_while_idle_is_noticed_and_replaced(sqlite_engine: Engine, tmp_path: Path) -> None:
    """Killed between requests, it was found only by the next request, which failed; until then
    /readyz said ready. The supervisor's tick notices the exit with no request and no probe."""
    loads: list[str] = []
    loaded = threading.Event()  # holds the replacement's load, so that readiness is seen meanwhile

    def load(tag: str) -> ScoringBackend:
        loads.append(tag)
        loaded.wait(WAIT_S)
        return ScoringBackend(tag, ThreadPoolExecutor(max_workers=1), score_or_hang)

    async def scenario() -> None:
        scorer = await started_scorer(score_or_hang, sqlite_engine, tmp_path / "outbox.sqlite3", model_version=MODEL)
        doomed = ScoringProcess(multiprocessing.get_context("forkserver"))
        await bounded(scorer.swap(ScoringBackend(MODEL, doomed, score_or_hang)))
        assert (await scored(scorer, "before")).status == "scored"
        assert scorer.ready()
        supervisor = PoolSupervisor(scorer, load=load, interval_s=0.05, load_timeout_s=5, discard=terminate)
        supervisor.start()
        try:
            assert doomed.pid is not None
            os.kill(doomed.pid, signal.SIGKILL)
            await until_async(lambda: loads, message="no replacement started for a process that exited")
            assert not scorer.ready() and not scorer.scoring_available() and scorer.alive()
            loaded.set()
            await until_async(scorer.ready)
            assert scorer.executor is not doomed and not doomed.process.is_alive()
            assert (await scored(scorer, "after")).status == "scored"
            assert loads == [MODEL]
        finally:
            loaded.set()
            await supervisor.close()
            await scorer.close()
            scorer.executor.shutdown()

    asyncio.run(scenario())


def test_a_promotion_during_the_replacement_of_a_dead_process_is_kept(sqlite_engine: Engine, tmp_path: Path) -> None:
    """v1's process died; while its replacement warmed up, the watcher swapped v2 in. The
    replacement then swapped v1 back over a healthy v2; now it is discarded and v2 serves on."""
    v1, v2 = FakeVersion("v1", 0.25), FakeVersion("v2", 0.75)
    store = FakeStore(v1, v2)

    async def scenario() -> None:
        scorer = await serving(store, sqlite_engine, tmp_path)
        await bounded(scorer.swap(ScoringBackend("v1", DeadPool(max_workers=1), v1)))
        lost = await score(scorer, "lost")
        assert lost.error is not None and lost.error.reason == SCORING_PROCESS_DIED
        assert not scorer.scoring_available()

        supervisor = PoolSupervisor(scorer, load=store.load, interval_s=60, load_timeout_s=5, discard=terminate)
        v1.warm_up_gate.clear()
        warmed_before = len(v1.batches)
        restoring = asyncio.create_task(supervisor.restore_once())
        await until_async(lambda: len(v1.batches) > warmed_before)  # the replacement is warming up
        assert await bounded(watcher_for(scorer, store, FakeClock(1000.0)).swap_to("v2")) == "succeeded"
        assert scorer.model_version == "v2" and scorer.ready()

        v1.warm_up_gate.set()
        assert await bounded(restoring) is False
        assert scorer.model_version == "v2"
        after = await score(scorer, "after")
        assert (after.model_version, after.score) == ("v2", 0.75)
        assert store.pools["v1"][-1].shut_down, "the replacement meant for the dead v1 is discarded"
        assert scorer.restore_failures == 0, "a promotion is no failed repair"
        await scorer.close()
        scorer.executor.shutdown()

    asyncio.run(scenario())
