"""The online scorer: admission, coalescing of duplicates, the adaptive batcher and persistence,
wired once per server process. Framework-free, so tests can drive it in-process.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import sqlite3
import time
from concurrent.futures import Executor

from sqlalchemy.engine import Engine

from inference.spec import LoadedSpec
from inference.spec.api import RecordBase
from serving.admission import AimdLimit, BatchCostModel, Decision
from serving.backends import BackendSwitch, ScoringBackend, warm_up_backend
from serving.batcher import EXPIRED, SCORING_PROCESS_DIED, AdaptiveBatcher, ProcessFn, Reservation, WorkItem
from serving.breaker import BreakerState, CircuitBreaker
from serving.idempotency import Admission, IdempotencyKeys, request_fingerprint
from serving.metrics import ServingMetrics
from serving.outbox import Outbox
from serving.schemas import ItemResult, api_models
from serving.scoring import BatchResult, ItemSpec, ping_store
from serving.settings import ServingSettings
from serving.shadow import ShadowScorer
from serving.writer import ResultWriter

logger = logging.getLogger(__name__)

# Per-batch forgetting factor of the batch cost estimate: it follows a slower machine within tens of batches.
COST_DECAY = 0.9
# A scoring process that cannot be replaced this many times running is past in-process repair.
RESTORE_ATTEMPTS_BEFORE_RESTART = 3


class Shed(Exception):
    def __init__(self, decision: Decision) -> None:
        super().__init__(decision.reason)
        self.decision = decision


class DeadlineExceeded(Exception):
    pass


class OnlineScorer:
    """The online path in one server process: it owns the batcher and the scoring backend, the
    idempotency keys, the result writer with its outbox, and the breaker those share; it is ready
    once a warm-up has run end to end.
    """

    def __init__(
        self,
        *,
        spec: LoadedSpec,
        process: ProcessFn,
        executor: Executor,
        model_version: str,
        engine: Engine,
        settings: ServingSettings,
        outbox: Outbox,
        metrics: ServingMetrics,
    ) -> None:
        """`process` scores a batch of `spec`'s records on `executor` (the scoring process; a
        thread in tests)."""
        self.spec = spec
        self.api = api_models(spec)
        self.settings = settings
        self.engine = engine
        self.metrics = metrics
        self.outbox = outbox
        self.backends = BackendSwitch(ScoringBackend(model_version, executor, process), self._switched)
        self.breaker = CircuitBreaker(
            settings.breaker_failure_threshold, settings.breaker_reset_s, probe=functools.partial(ping_store, engine)
        )
        self.cost = BatchCostModel(COST_DECAY)
        self.concurrency = AimdLimit(settings.p99_target_ms / 1000, settings.max_concurrency)
        self.writer = ResultWriter(
            spec,
            engine,
            self.breaker,
            outbox,
            metrics,
            drain_interval_s=settings.outbox_drain_interval_s,
            coalesce_s=settings.write_coalesce_ms / 1000,
        )
        self.keys = IdempotencyKeys(
            engine,
            self.breaker,
            results=self.api.results,
            # An unanswered claim outlives its request only when the process holding it died.
            stale_after_s=max(2 * settings.request_timeout_ms / 1000, 10.0),
        )
        # Identical items being scored now, by (record, body): a duplicate waits for the first.
        self.in_flight: dict[tuple[str, str], WorkItem] = {}
        self.restore_failures = 0  # consecutive failed attempts to replace a dead scoring process
        self.batcher: AdaptiveBatcher | None = None
        # The challenger, once ChallengerWatcher installs one: offered what the champion answered.
        self.shadow = ShadowScorer(
            spec=spec,
            engine=engine,
            settings=settings,
            metrics=metrics,
            champion_queued=lambda: 0 if self.batcher is None else self.batcher.queued,
            champion_busy=lambda: self.batcher is not None and self.batcher.busy,
        )
        self.warm = False
        metrics.p99_target.set(settings.p99_target_ms / 1000)
        metrics.concurrency_limit.set(self.concurrency.limit)
        metrics.serving_model(model_version)

    # ------------------------------------------------------------------ lifecycle
    def warm_up(self, rounds: int = 3) -> list[tuple[int, float]]:
        """Run real inferences end to end and seed the cost model with their timings."""
        samples = warm_up_backend(
            self.spec, self.backends.serving, max_batch_size=self.settings.max_batch_size, rounds=rounds
        )
        self.cost.calibrate(samples)
        self.warm = True
        logger.info("warm: batch cost %.1f ms + %.3f ms/item", self.cost.fixed_s * 1000, self.cost.per_item_s * 1000)
        return samples

    async def start(self) -> None:
        self.batcher = AdaptiveBatcher(
            self.process,
            executor=self.backends.dispatch,
            max_batch=self.settings.max_batch_size,
            capacity=self.settings.queue_capacity,
            target_s=self.settings.p99_target_ms / 1000,
            cost=self.cost,
            metrics=self.metrics,
            model_version=self.model_version,
            results=self.api.item_result,
            # Past the longest deadline a request can have, no item of a batch is waited for.
            stuck_after_s=self.settings.max_deadline_ms / 1000,
            on_batch=self._after_batch,
        )
        self.batcher.start()
        self.writer.start()
        self.shadow.start()

    @property
    def model_version(self) -> str:
        return self.backends.serving.model_version

    @property
    def process(self) -> ProcessFn:
        return self.backends.serving.process

    @property
    def executor(self) -> Executor:
        return self.backends.serving.executor

    def swap(self, backend: ScoringBackend) -> asyncio.Future[ScoringBackend]:
        """Serve `backend` (already warm) from the next batch on (see `BackendSwitch.swap`)."""
        return self.backends.swap(backend)

    def _switched(self, backend: ScoringBackend) -> None:
        if self.batcher is not None:
            self.batcher.switch_backend(backend.process, backend.model_version)
        self.metrics.serving_model(backend.model_version)

    def restore_failed(self) -> int:
        """One more failed attempt to replace a dead scoring process; returns how many in a row."""
        self.restore_failures += 1
        return self.restore_failures

    def restored(self) -> None:
        self.restore_failures = 0

    async def close(self, drain_s: float = 0.0) -> None:
        """Stop shadowing and batching, write what was submitted, and drain the outbox for up to `drain_s`."""
        await self.shadow.close()
        if self.batcher is not None:
            await self.batcher.stop()
        await asyncio.to_thread(self.writer.close, drain_s)
        self.outbox.close()

    def scoring_available(self) -> bool:
        """False from the moment the scoring process is found dead until a new one is swapped in."""
        return self.batcher is None or not self.batcher.broken

    def check_scoring_process(self) -> bool:
        """`scoring_available`, once it has looked whether the process exited while idle: for the
        supervisor's tick and readiness, not per request (it asks the OS)."""
        return self.batcher is None or not self.batcher.process_lost(self.executor)

    def alive(self) -> bool:
        """Liveness: a dead scoring process is replaced in-process; only when that keeps failing
        does the server ask to be restarted."""
        return self.scoring_available() or self.restore_failures < RESTORE_ATTEMPTS_BEFORE_RESTART

    def ready(self) -> bool:
        if not self.warm or self.batcher is None or not self.check_scoring_process():
            return False
        # A batch running past the default deadline answers no newcomer in time: out of rotation
        # until it ends, or until the stuck bound stops its process.
        if self.batcher.in_flight_for() > self.settings.request_timeout_ms / 1000:
            return False
        if self.breaker.state is BreakerState.CLOSED:
            return True
        try:
            self.outbox.depth()
        except sqlite3.Error:
            return False
        return True

    # ------------------------------------------------------------------ requests
    def admit(self, deadline: float) -> Reservation | Decision:
        """Admission, once per request before its body is read: a `Reservation` (its place in the
        queue; the request's end goes to `finished`) or the refusal's `Decision`."""
        if self.batcher is None:
            raise RuntimeError("start() first")
        admitted = self.batcher.reserve(deadline)
        if not isinstance(admitted, Decision) and not self.concurrency.acquire():
            admitted.release()
            admitted = Decision(
                False, self.batcher.decide(1, deadline).predicted_wait_s, self.concurrency.target_s, "concurrency_limit"
            )
        if isinstance(admitted, Decision):
            self.metrics.shed_by_reason[admitted.reason or "unknown"].inc()
        self.metrics.concurrency_limit.set(self.concurrency.limit)
        return admitted

    def finished(self, latency_s: float | None) -> None:
        """An admitted request ended: answered after `latency_s`, or refused for its body (None)."""
        self.concurrency.release(latency_s)

    async def score(
        self,
        records: list[RecordBase],
        *,
        request_id: str,
        idempotency_key: str | None,
        deadline: float,
        reservation: Reservation | None = None,
    ) -> tuple[list[ItemResult], float]:
        """Answers in request order, and the CPU seconds of the batches spent on them. Items take
        the `reservation`'s place in the queue; without one (in-process callers) they are admitted here.

        Raises Shed, DeadlineExceeded, KeyReused or KeyInProgress.
        """
        if idempotency_key is None:
            return await self._score_items(
                records, request_id=request_id, key=None, deadline=deadline, reservation=reservation
            )
        fingerprint = request_fingerprint(records)
        try:
            admission = await self.keys.admit(idempotency_key, fingerprint, request_id=request_id, deadline=deadline)
        except TimeoutError as error:
            raise DeadlineExceeded from error
        if admission.results is not None:
            return admission.results, 0.0
        return await self._score_keyed(
            records,
            admission,
            request_id=request_id,
            key=idempotency_key,
            deadline=deadline,
            reservation=reservation,
        )

    async def _score_keyed(
        self,
        records: list[RecordBase],
        admission: Admission,
        *,
        request_id: str,
        key: str,
        deadline: float,
        reservation: Reservation | None,
    ) -> tuple[list[ItemResult], float]:
        """Score under a key this request holds; then store the answer, or free the key when the
        request got none (shed, expired, the scoring process died), so that a retry may score."""
        try:
            results, cpu = await self._score_items(
                records, request_id=request_id, key=key, deadline=deadline, reservation=reservation
            )
        except BaseException:
            self.keys.release(key, admission, request_id=request_id)
            raise
        if any(r.error is not None and r.error.reason == SCORING_PROCESS_DIED for r in results):
            self.keys.release(key, admission, request_id=request_id)
            return results, cpu
        try:
            # A full answer goes out only once stored as the key's answer: what the client gets is
            # what a restart or another replica replays.
            return await self.keys.complete(key, admission, results, request_id=request_id, deadline=deadline), cpu
        except TimeoutError as error:
            raise DeadlineExceeded from error

    async def _score_items(
        self,
        records: list[RecordBase],
        *,
        request_id: str,
        key: str | None,
        deadline: float,
        reservation: Reservation | None,
    ) -> tuple[list[ItemResult], float]:
        assert self.batcher is not None, "start() first"
        batcher = self.batcher
        plan: list[WorkItem] = []
        fresh: list[WorkItem] = []
        now = time.monotonic()
        loop = asyncio.get_running_loop()
        id_name = self.spec.id.name
        for record in records:
            raw = record.to_raw()
            # Only a truly identical item coalesces: same record, same body.
            identity = (raw[id_name], request_fingerprint([record]))
            running = self.in_flight.get(identity)
            # A done item leaves `in_flight` only when its callback runs: it is no answer to join.
            if running is not None and not running.abandoned and not running.future.done():
                plan.append(running)
                continue
            item = WorkItem(
                ItemSpec(raw=raw, record_id=identity[0], request_id=request_id, idempotency_key=key),
                deadline,
                now,
                loop.create_future(),
            )
            plan.append(item)
            fresh.append(item)
            self.in_flight[identity] = item
            item.future.add_done_callback(functools.partial(self._forget, identity, item))
        if fresh:
            decision = None if reservation is not None else batcher.decide(len(fresh), deadline)
            if decision is not None and not decision.admitted:
                for item in fresh:
                    item.future.cancel()  # and so out of in_flight
                self.metrics.shed_by_reason[decision.reason or "unknown"].inc()
                raise Shed(decision)
            batcher.enqueue(fresh)
        if reservation is not None:
            reservation.release()
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
            self.backends.between_batches()

    def _record_batch(self, batch: list[WorkItem], outcome: BatchResult) -> None:
        share = outcome.cpu_seconds / max(len(batch), 1)
        finished = time.monotonic()
        waited_ms = {item.record_id: (finished - item.enqueued_at) * 1000 for item in batch}
        for item, result in zip(batch, outcome.results, strict=True):
            item.cpu_share = share
            if result.error is not None:
                self.metrics.item_errors.labels(reason=result.error.reason).inc()
            if result.degraded:
                self.metrics.degraded.inc()
        for row in outcome.rows:
            row["latency_ms"] = waited_ms.get(row["record_id"])
        self.writer.submit_rows(outcome.rows)
        self.writer.submit_rejections(outcome.rejected)
        self.shadow.offer([item.spec for item in batch], outcome)
        self.metrics.breaker_state.set(max(int(self.breaker.state), outcome.breaker_state))
