"""Model promotion without a restart.

In-process first, with hand-written fakes for the scoring step of each version (a thread pool
each): the swap waits for warm-up, a failed version never serves, a batch already on the old
pool finishes there. Then against a real `bentoml serve` under steady load: promote, roll back.
"""

from __future__ import annotations

import asyncio
import functools
import math
import multiprocessing
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from concurrent.futures import CancelledError, ProcessPoolExecutor, ThreadPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from datetime import date, datetime
from pathlib import Path
from typing import Any, TypeVar

import httpx
import numpy as np
import polars as pl
import psutil
import pytest
import torch
from sqlalchemy.engine import Engine

from inference.contract import FrameHistory, TorchPredictor
from inference.lineage import TransactionLineage, explain
from inference.model import ModelConfig, RiskModel
from inference.records import RAW_COLUMNS
from inference.store import make_engine, read_predictions, utc_now
from serving.backends import ScoringBackend
from serving.lifecycle import ModelWatcher
from serving.metrics import ServingMetrics
from serving.outbox import Outbox
from serving.runtime import OnlineScorer
from serving.schemas import ItemError, ItemResult
from serving.scoring import BatchResult, ItemSpec
from serving.settings import ServingSettings
from serving.worker import discard_pool
from tandem import modelstore
from tests.serving.support import DemoServer, FakeClock, StartDemoServer, scored_batch, transaction
from tests.shared import WAIT_S, register_model, until, until_async

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
        ids = [str(spec.raw["transaction_id"]) for spec in specs]
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
    def __init__(self) -> None:
        super().__init__(max_workers=1)
        self.shut_down = False

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        self.shut_down = True
        super().shutdown(wait, cancel_futures=cancel_futures)


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
        discard=discard_pool,
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
        stored = read_predictions(conn).sort("transaction_id")
    assert stored.select("transaction_id", "model_version", "path").rows() == [
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


def _running(pid: int | None) -> bool:
    try:
        return pid is not None and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_discarding_a_pool_stops_a_process_stuck_in_its_load() -> None:
    pool = ProcessPoolExecutor(
        max_workers=1, mp_context=multiprocessing.get_context("spawn"), initializer=time.sleep, initargs=(600,)
    )
    pending = pool.submit(math.sqrt, 4.0)
    processes = list(pool._processes.values())
    assert processes and all(process.is_alive() for process in processes)
    started = time.monotonic()
    discard_pool(pool)
    assert time.monotonic() - started < 12
    # By pid, not is_alive(): the pool's manager thread may reap the child first, and then
    # Process.is_alive() still says True for a process that no longer exists.
    assert not any(_running(process.pid) for process in processes)
    # Cancelled if the pool had not yet handed it to the process, else failed with the process.
    with pytest.raises((BrokenProcessPool, CancelledError)):
        pending.result(timeout=5)


# ---------------------------------------------------------------------------------------- live

MODEL_NAME = "risk_model"
HISTORY_DAY = date(2026, 12, 1)
REQUEST_DAY = date(2026, 12, 2)
RATE = 30.0  # requests per second, one distinct transaction each
POLL_S = 0.25
# Generous for two shared, noisy cores: the point is that nothing fails or stalls during the swap,
# not the 50 ms production target (admission at that target is unit-tested in-process).
TARGET_MS = 1000
# Under the 2 s default request deadline: with default settings no client would have timed out.
# Measured with neighbours' test runs on the same two cores: 0.12-0.3 s, about the p99 before the
# change; up to 1.2 s when the promotion overlapped the server's first seconds under load.
SWAP_P99_BOUND_MS = 1500.0
DAGSTER_UI = "http://127.0.0.1:3000"


@dataclass
class SwapServer(DemoServer):
    v1: str
    v2: str
    models: dict[str, RiskModel]


@dataclass(frozen=True)
class Answer:
    transaction_id: str
    sent_at: float  # seconds since the load started
    latency_ms: float
    status: int
    result: dict[str, Any] | None  # the one ItemResult, when the status is 200

    @property
    def version(self) -> str | None:
        return None if self.result is None else str(self.result["model_version"])


def _seeded_model(seed: int) -> RiskModel:
    torch.manual_seed(seed)
    return RiskModel(ModelConfig()).eval()


@pytest.fixture(scope="module")
def swap_server(start_demo_server: StartDemoServer) -> Iterator[SwapServer]:
    models = {}
    tags = []
    for seed in (0, 1):
        model = _seeded_model(seed)
        tag = register_model(model, MODEL_NAME, promote=False)
        models[tag] = model
        tags.append(tag)
    v1, v2 = tags
    modelstore.promote(v1)

    env = {
        "TANDEM_SERVING_P99_TARGET_MS": str(TARGET_MS),
        "TANDEM_SERVING_REQUEST_TIMEOUT_MS": "10000",
        "TANDEM_SERVING_MODEL_POLL_INTERVAL_S": str(POLL_S),
        "TANDEM_SERVING_OUTBOX_DRAIN_INTERVAL_S": "0.2",
    }
    days = (HISTORY_DAY, REQUEST_DAY)
    with start_demo_server(
        SwapServer, "swap", days, rows=2000, accounts=150, env=env, v1=v1, v2=v2, models=models
    ) as live:
        yield live


async def steady_load(
    server: SwapServer,
    rows: Iterator[dict[str, Any]],
    *,
    change: Callable[[], Awaitable[None]],
    change_after_s: float,
    expect: str,
    settle_s: float,
    max_s: float,
) -> tuple[list[Answer], float]:
    """Open-loop load at RATE, one fresh transaction per request; `change` (a promotion or a
    rollback) runs `change_after_s` in. Stops `settle_s` after the first answer from `expect`,
    or at `max_s`. Returns the answers and when the change was made (seconds since the start)."""
    answers: list[Answer] = []
    changed_at = math.inf
    limits = httpx.Limits(max_connections=500, max_keepalive_connections=500)
    async with httpx.AsyncClient(timeout=15, limits=limits) as client:
        begin = time.perf_counter()

        async def one(row: dict[str, Any]) -> None:
            sent = time.perf_counter()
            try:
                response = await client.post(f"{server.url}/score", json={"transactions": [row]})
                status = response.status_code
                result = response.json()["results"][0] if status == 200 else None
            except httpx.HTTPError:
                status, result = -1, None
            done = time.perf_counter()
            answers.append(Answer(row["transaction_id"], sent - begin, (done - sent) * 1000, status, result))

        async def make_change() -> None:
            nonlocal changed_at
            await asyncio.sleep(change_after_s)
            await change()
            changed_at = time.perf_counter() - begin

        changing = asyncio.create_task(make_change())
        tasks = []
        for index, row in enumerate(rows):
            elapsed = time.perf_counter() - begin
            first = min((a.sent_at + a.latency_ms / 1000 for a in answers if a.version == expect), default=None)
            if elapsed > max_s or (first is not None and elapsed > first + settle_s):
                break
            delay = begin + index / RATE - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(row)))
        await changing
        await asyncio.gather(*tasks)
    return answers, changed_at


def _check_switch(answers: list[Answer], old: str, new: str, changed_at: float) -> list[Answer]:
    """No failures, and in the server's order (produced_at) the old version, then only the new one."""
    failed = [
        (a.status, a.result) for a in answers if a.status != 200 or a.result is None or a.result["status"] != "scored"
    ]
    assert not failed, failed[:5]
    ordered = sorted(answers, key=lambda a: datetime.fromisoformat(str(a.result["produced_at"])) if a.result else 0)
    versions = [a.version for a in ordered]
    assert set(versions) == {old, new}, set(versions)
    switch = versions.index(new)
    assert versions[:switch] == [old] * switch and versions[switch:] == [new] * (len(versions) - switch), (
        "answers went back to the old version after the new one"
    )
    assert min(a.sent_at for a in answers if a.version == new) >= changed_at - 0.5, "new version before the change"
    return ordered


def _p99(latencies: list[float]) -> float:
    return float(np.percentile(latencies, 99)) if latencies else math.nan


def _swap_latency(answers: list[Answer], changed_at: float, new: str, what: str) -> str:
    """p99 in the 2 s before the change and while it is picked up (change to first new answer, + 1 s)."""
    first_new = min(a.sent_at for a in answers if a.version == new)
    before = [a.latency_ms for a in answers if changed_at - 2.0 <= a.sent_at < changed_at]
    during = [a.latency_ms for a in answers if changed_at <= a.sent_at <= first_new + 1.0]
    report = (
        f"{what}: {len(answers)} requests at {RATE:.0f} rps; p99 before {_p99(before):.0f} ms; "
        f"{first_new - changed_at:.1f} s to the first answer of the new version; p99 during the swap "
        f"{_p99(during):.0f} ms (max {max(during):.0f} ms, n={len(during)})"
    )
    print(report)
    assert _p99(during) < SWAP_P99_BOUND_MS, report
    return report


def _rows_for_lineage(server: SwapServer, answers: list[Answer]) -> None:
    engine = make_engine(server.database_url)

    def stored(transaction_id: str) -> TransactionLineage | None:
        found = explain(engine, transaction_id, dagster_ui_url=DAGSTER_UI)
        return found if found.results else None

    try:
        for answer in answers:
            assert answer.result is not None
            found = until(
                functools.partial(stored, answer.transaction_id), timeout_s=15, interval_s=0.1, message=repr(answer)
            )
            assert len(found.results) == 1, found
            row = found.results[0]
            assert row.model_version == answer.version
            assert row.path == "online"
            assert row.request_id == answer.result["request_id"]
            assert row.batch_id == answer.result["batch_id"]
            assert row.producer == f"request {row.request_id} batch {row.batch_id}"
            assert row.score == pytest.approx(answer.result["score"])
            assert row.dagster_run_url is None
            assert found.source_found is False, "online requests are not source records"
    finally:
        engine.dispose()


@pytest.mark.live
@pytest.mark.postgres
def test_promotion_and_rollback_under_load_fail_nothing(swap_server: SwapServer) -> None:
    server = swap_server
    started = time.perf_counter()
    rows = iter(server.requests.to_dicts())
    assert server.metric("tandem_serving_model_info", model_version=server.v1) == 1

    answers, promoted_at = asyncio.run(
        steady_load(
            server,
            rows,
            change=lambda: asyncio.to_thread(modelstore.promote, server.v2),
            # Past the first seconds after readiness, which are slower whatever happens (measured:
            # p99 ~2x), so the swap's own cost is what the window shows.
            change_after_s=6.0,
            expect=server.v2,
            settle_s=3.0,
            max_s=45.0,
        )
    )
    if not any(a.version == server.v2 for a in answers):
        pytest.fail(f"v2 never answered; server log: {server.log_text()[-3000:]}")
    ordered = _check_switch(answers, server.v1, server.v2, promoted_at)
    _swap_latency(answers, promoted_at, server.v2, "promotion")

    # The new version's answers are its own scores, not the old model's with a new label: each
    # record of its first batches re-scored alone against the stored history (records of one batch
    # never read each other).
    by_id = {str(row["transaction_id"]): row for row in server.requests.to_dicts()}
    predictor = TorchPredictor(server.models[server.v2], server.v2)
    history = FrameHistory(server.history)
    first_batches = list(
        dict.fromkeys(str(a.result["batch_id"]) for a in ordered if a.result and a.version == server.v2)
    )
    for batch_id in first_batches[:3]:
        for answer in (a for a in answers if a.result and a.result["batch_id"] == batch_id):
            assert answer.result is not None
            alone = pl.DataFrame([by_id[answer.transaction_id]]).select(RAW_COLUMNS)
            expected = predictor.predict(alone, history)["score"][0]
            assert answer.result["score"] == pytest.approx(expected, abs=1e-5)

    assert server.metric("tandem_serving_model_info", model_version=server.v2, code_version="test") == 1
    assert server.metric("tandem_serving_model_info", model_version=server.v1) == 0
    assert server.metric("tandem_serving_model_swaps_total", outcome="succeeded") == 1
    assert server.metric("tandem_serving_model_swaps_total", outcome="failed") == 0

    switch = [a.version for a in ordered].index(server.v2)
    around = ordered[switch - 3 : switch + 3]
    assert [a.version for a in around] == [server.v1] * 3 + [server.v2] * 3
    _rows_for_lineage(server, around)

    answers, rolled_back_at = asyncio.run(
        steady_load(
            server,
            rows,
            change=lambda: asyncio.to_thread(assert_rolled_back_to, server.v1),
            change_after_s=2.0,
            expect=server.v1,
            settle_s=1.0,
            max_s=40.0,
        )
    )
    _check_switch(answers, server.v2, server.v1, rolled_back_at)
    _swap_latency(answers, rolled_back_at, server.v1, "rollback")
    assert server.metric("tandem_serving_model_info", model_version=server.v1) == 1
    assert server.metric("tandem_serving_model_info", model_version=server.v2) == 0
    assert server.metric("tandem_serving_model_swaps_total", outcome="succeeded") == 2
    print(f"hot swap live test: {time.perf_counter() - started:.1f} s after the server was ready")


def assert_rolled_back_to(expected: str) -> None:
    assert modelstore.rollback(MODEL_NAME) == expected
