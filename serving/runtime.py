"""The online scorer: admission, coalescing of duplicates, the adaptive batcher and persistence,
wired once per worker. Framework-free, so tests can drive it in-process; the BentoML service and
the HTTP app are thin shells around it.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import sqlite3
import time
from collections.abc import Callable
from concurrent.futures import Executor, Future
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any, ParamSpec, TypeVar

from sqlalchemy.engine import Engine

from inference.records import MERCHANT_CATEGORIES, Transaction, raw_frame, validate
from serving.admission import BatchCostModel, Decision
from serving.batcher import EXPIRED, SCORING_PROCESS_DIED, AdaptiveBatcher, ProcessFn, WorkItem
from serving.breaker import BreakerState, CircuitBreaker
from serving.idempotency import (
    Admission,
    IdempotencyKeys,
    KeyInProgress,
    KeyReused,
    request_fingerprint,
)
from serving.metrics import ServingMetrics
from serving.outbox import Outbox
from serving.schemas import ItemResult
from serving.scoring import BatchResult, ItemSpec
from serving.settings import ServingSettings
from serving.writer import ResultWriter

logger = logging.getLogger(__name__)

_P = ParamSpec("_P")
_T = TypeVar("_T")

SCHEMA_INVALID = "schema_invalid"
# A scoring process that cannot be replaced this many times running is past in-process repair.
RESTORE_ATTEMPTS_BEFORE_RESTART = 3


class Shed(Exception):
    def __init__(self, decision: Decision) -> None:
        super().__init__(decision.reason)
        self.decision = decision


class DeadlineExceeded(Exception):
    pass


class ScoringUnavailable(Exception):
    """The batch was lost with the scoring process: no answer about its items."""


@dataclass(frozen=True)
class ScoringBackend:
    """One model version's scoring step: the version, the pool it runs on and the function the pool calls."""

    model_version: str
    executor: Executor
    process: ProcessFn


class _BatchDispatch(Executor):
    """The batcher's executor: forwards to the serving version's pool and notes that a batch has
    started, so a model swap waits for the end of that batch (and of its item-by-item retries)
    instead of sending half of it to another version."""

    def __init__(self, target: Executor) -> None:
        self.target = target
        self.busy = False

    def submit(self, fn: Callable[_P, _T], /, *args: _P.args, **kwargs: _P.kwargs) -> Future[_T]:
        self.busy = True
        return self.target.submit(fn, *args, **kwargs)

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        self.target.shutdown(wait, cancel_futures=cancel_futures)


def warm_up_backend(
    executor: Executor, process: ProcessFn, *, max_batch_size: int, rounds: int = 3, timeout_s: float | None = None
) -> list[tuple[int, float]]:
    """Score synthetic records through the whole path (store reads included, writes excluded) at
    batch size 1 and the largest batch; returns (batch size, seconds) samples for the cost model.

    Raises if any answer is not a finite score, or (TimeoutError) past `timeout_s` in all.
    """
    deadline = None if timeout_s is None else time.monotonic() + timeout_s

    def run(specs: list[ItemSpec]) -> BatchResult:
        remaining = None if deadline is None else max(deadline - time.monotonic(), 0.0)
        return executor.submit(process, specs).result(timeout=remaining)

    sizes = (1, max_batch_size)
    specs = [_warm_up_spec(i) for i in range(max(sizes))]
    run(specs[:1])  # the first call pays lazy init (the process, the model, the connection)
    samples: list[tuple[int, float]] = []
    for _ in range(rounds):
        for n in sizes:
            started = time.perf_counter()
            outcome = run(specs[:n])
            samples.append((n, time.perf_counter() - started))
            if any(r.status != "scored" or r.score is None or not math.isfinite(r.score) for r in outcome.results):
                raise RuntimeError(f"warm-up inference failed: {outcome.results[0]}")
    return samples


class OnlineScorer:
    def __init__(
        self,
        *,
        process: ProcessFn,
        executor: Executor,
        model_version: str,
        engine: Engine,
        settings: ServingSettings,
        outbox: Outbox,
        metrics: ServingMetrics,
    ) -> None:
        """`process` scores a batch on `executor` (the scoring process in production, a thread in
        tests); `engine` is the server process's own, for writes."""
        self.settings = settings
        self.engine = engine
        self.metrics = metrics
        self.outbox = outbox
        self.process = process
        self.executor = executor
        self.model_version = model_version
        self._dispatch = _BatchDispatch(executor)
        self._pending_swap: tuple[ScoringBackend, asyncio.Future[ScoringBackend]] | None = None
        self.breaker = CircuitBreaker(settings.breaker_failure_threshold, settings.breaker_reset_s)
        self.cost = BatchCostModel(settings.cost_decay)
        self.writer = ResultWriter(
            engine,
            self.breaker,
            outbox,
            metrics,
            drain_interval_s=settings.outbox_drain_interval_s,
            drain_chunk=settings.outbox_drain_chunk,
        )
        self.keys = IdempotencyKeys(
            engine,
            self.breaker,
            size=settings.idempotency_cache_size,
            # An unanswered claim outlives its request only when the process holding it died.
            stale_after_s=max(2 * settings.request_timeout_ms / 1000, 10.0),
        )
        # Identical items being scored now, by (transaction, body): a duplicate waits for the first.
        self.in_flight: dict[tuple[str, str], WorkItem] = {}
        self.restore_failures = 0  # consecutive failed attempts to replace a dead scoring process
        self.batcher: AdaptiveBatcher | None = None
        self.warm = False
        metrics.p99_target.set(settings.p99_target_ms / 1000)
        metrics.serving_model(model_version)

    # ------------------------------------------------------------------ lifecycle
    def warm_up(self, rounds: int = 3) -> list[tuple[int, float]]:
        """Run real inferences end to end (see `warm_up_backend`) and seed the cost model with the timings."""
        samples = warm_up_backend(
            self.executor, self.process, max_batch_size=self.settings.max_batch_size, rounds=rounds
        )
        self.cost.calibrate(samples)
        self.warm = True
        logger.info("warm: batch cost %.1f ms + %.3f ms/item", self.cost.fixed_s * 1000, self.cost.per_item_s * 1000)
        return samples

    async def start(self) -> None:
        self.batcher = AdaptiveBatcher(
            self.process,
            executor=self._dispatch,
            max_batch=self.settings.max_batch_size,
            capacity=self.settings.queue_capacity,
            target_s=self.settings.p99_target_ms / 1000,
            cost=self.cost,
            metrics=self.metrics,
            model_version=self.model_version,
            on_batch=self._after_batch,
            burst_interval_s=self.settings.burst_interval_ms / 1000,
        )
        self.batcher.start()
        self.writer.start()

    def swap(self, backend: ScoringBackend) -> asyncio.Future[ScoringBackend]:
        """Serve `backend` (already warm) from the next batch on.

        The swap happens between two batches: at once when the batcher is idle, else when the
        running batch ends, so a batch dispatched to the old pool finishes there. Resolves to the
        replaced backend, which no batch can reach any more; cancelling it withdraws the swap.

        The batch cost model carries over and retunes itself from the new version's batches
        (decay 0.9: within about ten). Not recalibrated from the new version's warm-up: timed beside
        a pool that is serving, a first 64-item batch measured up to 7x its steady cost, and an
        overstated cost sheds requests right after the swap.
        """
        if self._pending_swap is not None:
            raise RuntimeError("a model swap is already pending")
        done: asyncio.Future[ScoringBackend] = asyncio.get_running_loop().create_future()
        self._pending_swap = (backend, done)
        done.add_done_callback(self._withdraw_swap)
        if not self._dispatch.busy:
            self._apply_swap()
        return done

    def _withdraw_swap(self, done: asyncio.Future[ScoringBackend]) -> None:
        if done.cancelled() and self._pending_swap is not None and self._pending_swap[1] is done:
            self._pending_swap = None

    def _apply_swap(self) -> None:
        if self._pending_swap is None:
            return
        backend, done = self._pending_swap
        self._pending_swap = None
        previous = ScoringBackend(self.model_version, self.executor, self.process)
        # Everything a batch or a request reads, switched in one synchronous step of the event
        # loop, so no batch and no request sees half of each version.
        self.process, self.executor, self.model_version = backend.process, backend.executor, backend.model_version
        self._dispatch.target = backend.executor
        if self.batcher is not None:
            self.batcher.process = backend.process
            self.batcher.model_version = backend.model_version
            # Every swap installs a warmed-up process: whatever broke the old one is behind us.
            self.batcher.broken = False
        self.metrics.serving_model(backend.model_version)
        logger.info("now serving %s (was %s)", backend.model_version, previous.model_version)
        done.set_result(previous)

    async def close(self, drain_s: float = 0.0) -> None:
        """Stop batching, write what was submitted, and drain the outbox for up to `drain_s`."""
        if self.batcher is not None:
            await self.batcher.stop()
        await asyncio.to_thread(self.writer.close, drain_s)
        self.outbox.close()

    def scoring_available(self) -> bool:
        """False from the moment the scoring process is found dead until a new one is swapped in."""
        return self.batcher is None or not self.batcher.broken

    def alive(self) -> bool:
        """Liveness: a dead scoring process is replaced in-process (`lifecycle.PoolSupervisor`);
        only when that keeps failing does the server ask to be restarted."""
        return self.scoring_available() or self.restore_failures < RESTORE_ATTEMPTS_BEFORE_RESTART

    def ready(self) -> bool:
        if not self.warm or self.batcher is None or not self.scoring_available():
            return False
        if self.breaker.state is BreakerState.CLOSED:
            return True
        try:
            self.outbox.depth()
        except sqlite3.Error:
            return False
        return True

    # ------------------------------------------------------------------ requests
    def refuse_early(self, deadline: float) -> Decision | None:
        """The refusal a single item would get now, before its request is even read; None to go on."""
        if self.batcher is None:
            return None
        decision = self.batcher.decide(1, deadline)
        if decision.admitted:
            return None
        self.metrics.shed.labels(reason=decision.reason or "unknown").inc()
        return decision

    async def score(
        self,
        transactions: list[Transaction],
        *,
        request_id: str,
        idempotency_key: str | None,
        deadline: float,
    ) -> tuple[list[ItemResult], float]:
        """Answers in request order, and the CPU seconds of the batches spent on them.

        Raises Shed (refused at admission), DeadlineExceeded, KeyReused (the key named another
        body) or KeyInProgress (another process is still answering the key).
        """
        if idempotency_key is None:
            return await self._score_items(transactions, request_id=request_id, key=None, deadline=deadline)
        fingerprint = request_fingerprint(transactions)
        try:
            admission = await self.keys.admit(idempotency_key, fingerprint, request_id=request_id, deadline=deadline)
        except TimeoutError as error:
            raise DeadlineExceeded from error
        if admission.results is not None:
            return admission.results, 0.0
        return await self._score_keyed(
            transactions, admission, request_id=request_id, key=idempotency_key, deadline=deadline
        )

    async def _score_keyed(
        self, transactions: list[Transaction], admission: Admission, *, request_id: str, key: str, deadline: float
    ) -> tuple[list[ItemResult], float]:
        """Score under a key this request holds; then store the answer, or free the key when the
        request got none (shed, expired, the scoring process died), so that a retry may score."""
        try:
            results, cpu = await self._score_items(transactions, request_id=request_id, key=key, deadline=deadline)
        except BaseException as error:
            self.keys.release(key, admission, error)
            self._store_key_outcome(admission, key, request_id, None)
            raise
        if any(r.error is not None and r.error.reason == SCORING_PROCESS_DIED for r in results):
            self.keys.release(key, admission, ScoringUnavailable())
            self._store_key_outcome(admission, key, request_id, None)
        else:
            self._store_key_outcome(admission, key, request_id, self.keys.complete(key, admission, results))
        return results, cpu

    def _store_key_outcome(self, admission: Admission, key: str, request_id: str, response: str | None) -> None:
        # Off the event loop and not awaited: the client's answer does not wait for its bookkeeping.
        if not admission.claimed_in_store:
            return
        loop = asyncio.get_running_loop()
        if response is None:
            loop.run_in_executor(None, self.keys.store_release, key, request_id)
        else:
            loop.run_in_executor(None, self.keys.store_answer, key, request_id, response)

    async def _score_items(
        self, transactions: list[Transaction], *, request_id: str, key: str | None, deadline: float
    ) -> tuple[list[ItemResult], float]:
        assert self.batcher is not None, "start() first"
        batcher = self.batcher
        plan: list[WorkItem] = []
        fresh: list[WorkItem] = []
        now = time.monotonic()
        loop = asyncio.get_running_loop()
        for tx in transactions:
            raw = tx.to_raw()
            # Only a truly identical item coalesces: same transaction, same body.
            identity = (tx.transaction_id, request_fingerprint([tx]))
            running = self.in_flight.get(identity)
            if running is not None and not running.abandoned:
                plan.append(running)
                continue
            item = WorkItem(
                ItemSpec(raw=raw, request_id=request_id, idempotency_key=key), deadline, now, loop.create_future()
            )
            plan.append(item)
            fresh.append(item)
            self.in_flight[identity] = item
            item.future.add_done_callback(functools.partial(self._forget, identity, item))
        if fresh:
            decision = batcher.decide(len(fresh), deadline)
            if not decision.admitted:
                for item in fresh:
                    item.future.cancel()  # and so out of in_flight
                self.metrics.shed.labels(reason=decision.reason or "unknown").inc()
                raise Shed(decision)
            batcher.enqueue(fresh)
        for item in plan:
            if item not in fresh:
                item.waiters += 1
                item.deadline = max(item.deadline, deadline)
        _, pending = await asyncio.wait([item.future for item in plan], timeout=deadline - time.monotonic())
        if pending or any(item.future.cancelled() or item.future.result() is EXPIRED for item in plan):
            for item in plan:
                batcher.abandon(item)
            raise DeadlineExceeded
        results: list[ItemResult] = []
        cpu = 0.0
        for item in plan:
            answer = item.future.result()
            assert isinstance(answer, ItemResult)
            results.append(answer)
            cpu += item.cpu_share
        return results, cpu

    def _forget(self, identity: tuple[str, str], item: WorkItem, _: object = None) -> None:
        if self.in_flight.get(identity) is item:
            del self.in_flight[identity]

    def _after_batch(self, batch: list[WorkItem], outcome: BatchResult) -> None:
        try:
            self._record_batch(batch, outcome)
        finally:
            # The batcher calls this between two batches: the one moment a swap may take effect.
            self._dispatch.busy = False
            self._apply_swap()

    def _record_batch(self, batch: list[WorkItem], outcome: BatchResult) -> None:
        share = outcome.cpu_seconds / max(len(batch), 1)
        finished = time.monotonic()
        waited_ms = {item.transaction_id: (finished - item.enqueued_at) * 1000 for item in batch}
        for item, result in zip(batch, outcome.results, strict=True):
            item.cpu_share = share
            if result.error is not None:
                self.metrics.item_errors.labels(reason=result.error.reason).inc()
            if result.degraded:
                self.metrics.degraded.inc()
        for row in outcome.rows:
            row["latency_ms"] = waited_ms.get(row["transaction_id"])
        self.writer.submit_rows(outcome.rows)
        self.writer.submit_rejections(outcome.rejected)
        self.metrics.breaker_state.set(max(int(self.breaker.state), outcome.breaker_state))

    def quarantine_invalid(self, items: list[Any], details: dict[int, str], request_id: str) -> None:
        """Best effort: record schema-invalid items (never scored) in rejected_records."""
        records = [(index, item) for index, item in enumerate(items) if isinstance(item, dict) and index in details]
        if not records:
            return
        reasons = validate(raw_frame([item for _, item in records]))["reject_reason"].to_list()
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
        self.writer.submit_rejections(rows)


def _warm_up_spec(index: int) -> ItemSpec:
    moment = datetime(2000, 1, 1, tzinfo=UTC) + timedelta(minutes=index)
    tx = Transaction(
        transaction_id=f"warm-up-{index}",
        account_id=f"warm-up-account-{index % 4}",
        amount=10.0 + index,
        # One ordinary country: warm-up proves the path works, not that every input does.
        currency="USD",
        merchant_category=MERCHANT_CATEGORIES[index % len(MERCHANT_CATEGORIES)],
        country="US",
        event_time=moment,
    )
    return ItemSpec(raw=tx.to_raw(), request_id="warm-up")


__all__ = [
    "DeadlineExceeded",
    "KeyInProgress",
    "KeyReused",
    "OnlineScorer",
    "ScoringBackend",
    "Shed",
    "warm_up_backend",
]
