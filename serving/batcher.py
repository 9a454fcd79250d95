"""Adaptive batching across concurrent requests, behind a bounded queue.

One batch runs at a time; whatever queued meanwhile is the next batch (up to `max_batch`), so the
batch size follows the load without a timing window. An item past its deadline is dropped before
work starts on it, and a batch that raises is retried item by item, so one item fails alone. A
scoring process that dies, or runs one call past `stuck_after_s`, fails its batch as a server fault.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Callable
from concurrent.futures import BrokenExecutor, Executor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field

from inference.store import utc_now
from serving.admission import BatchCostModel, Decision, admit
from serving.background import BackgroundTask
from serving.metrics import ServingMetrics
from serving.schemas import ItemError, ItemResult
from serving.scoring import BatchResult, ItemSpec
from serving.scoring_process import exited, run_on, terminate

logger = logging.getLogger(__name__)
# The reason on items whose batch was lost with the scoring process: a server fault (503).
SCORING_PROCESS_DIED = "scoring_process_died"


class Expired:
    """Resolution of an item whose deadline passed before its batch started."""


EXPIRED = Expired()


@dataclass(eq=False)
class WorkItem:
    spec: ItemSpec
    deadline: float
    enqueued_at: float
    future: asyncio.Future[ItemResult | Expired]
    waiters: int = 1
    abandoned: bool = field(default=False)
    started: bool = field(default=False)
    cpu_share: float = 0.0

    @property
    def record_id(self) -> str:
        return self.spec.record_id


ProcessFn = Callable[[list[ItemSpec]], BatchResult]
BatchHook = Callable[[list[WorkItem], BatchResult], None]


class Reservation:
    """An admitted request's place in the queue before its items are in it; released once."""

    __slots__ = ("_batcher",)

    def __init__(self, batcher: AdaptiveBatcher) -> None:
        self._batcher: AdaptiveBatcher | None = batcher

    def release(self) -> None:
        if self._batcher is not None:
            self._batcher.unreserve()
            self._batcher = None


class AdaptiveBatcher:
    """The queue of admitted items and the one loop that turns it into batches, on the event loop:
    `decide` is admission; queued items go to `process` on `executor` at most `max_batch` at a time,
    one batch in flight; `on_batch` sees every batch's outcome.
    """

    def __init__(
        self,
        process: ProcessFn,
        *,
        executor: Executor,
        max_batch: int,
        capacity: int,
        target_s: float,
        cost: BatchCostModel,
        metrics: ServingMetrics,
        model_version: str,
        results: type[ItemResult],
        stuck_after_s: float | None = None,
        on_batch: BatchHook | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.process = process
        self.executor = executor
        self.max_batch = max_batch
        self.capacity = capacity
        self.target_s = target_s
        self.cost = cost
        self.metrics = metrics
        self.on_batch = on_batch
        self.model_version = model_version
        self.results = results
        self.stuck_after_s = stuck_after_s
        self.clock = clock
        self._queue: collections.deque[WorkItem] = collections.deque()
        self._live = 0  # queued items someone still waits for
        self._reserved = 0  # admitted requests whose items are not queued yet
        self._wakeup = asyncio.Event()
        self._in_flight_since: float | None = None
        self._in_flight_size = 0
        self._task = BackgroundTask("tandem-batcher")
        self.broken = False

    def switch_backend(self, process: ProcessFn, model_version: str) -> None:
        """Score later batches with `process`, a warmed-up version: the old one's breakage is behind us."""
        self.process = process
        self.model_version = model_version
        self.broken = False

    def process_lost(self, serving: Executor) -> bool:
        """Whether the scoring process is lost: a batch failed with it, or `serving`'s process has
        exited. Polled by readiness and the supervisor, so that an idle process's death is noticed
        before a request fails on it; it then counts as broken, as after a lost batch."""
        if not self.broken and exited(serving):
            logger.error("the scoring process has exited; a new one will be started")
            self.broken = True
        return self.broken

    @property
    def queued(self) -> int:
        return self._live

    @property
    def busy(self) -> bool:
        """A batch is being scored or items are waiting for one."""
        return self._in_flight_since is not None or self._live > 0

    def in_flight_for(self) -> float:
        """Seconds the batch in flight has run; 0 when none is."""
        return 0.0 if self._in_flight_since is None else self.clock() - self._in_flight_since

    def in_flight_remaining(self) -> float:
        if self._in_flight_since is None:
            return 0.0
        expected = self.cost.batch_seconds(self._in_flight_size)
        return max(expected - (self.clock() - self._in_flight_since), 0.0)

    def decide(self, items: int, deadline: float) -> Decision:
        """Admission (`admission.admit`) for `items` more, behind what is queued and reserved."""
        return admit(
            items=items,
            queued=self._live + self._reserved,
            capacity=self.capacity,
            in_flight_remaining_s=self.in_flight_remaining(),
            max_batch=self.max_batch,
            cost=self.cost,
            target_s=self.target_s,
            remaining_deadline_s=deadline - self.clock(),
        )

    def reserve(self, deadline: float) -> Reservation | Decision:
        """Admit a request whose body is not read yet: it counts as one queued item until its items
        are enqueued, so a burst does not all see an empty queue."""
        decision = self.decide(1, deadline)
        if not decision.admitted:
            return decision
        self._reserved += 1
        return Reservation(self)

    def unreserve(self) -> None:
        self._reserved -= 1

    def enqueue(self, items: list[WorkItem]) -> None:
        self._queue.extend(items)
        self._live += len(items)
        self.metrics.queue_depth.set(self._live)
        self._wakeup.set()

    def abandon(self, item: WorkItem) -> None:
        """A waiter gave up; with none left, the item is dropped before work starts on it."""
        item.waiters -= 1
        # A done future before its start: `_take` resolved it (expired) and counted it out already.
        if item.waiters <= 0 and not item.started and not item.abandoned and not item.future.done():
            item.abandoned = True
            self._live -= 1
            self.metrics.queue_depth.set(self._live)

    def start(self) -> None:
        self._task.start(self._run)

    async def stop(self) -> None:
        await self._task.stop()

    def _take(self) -> list[WorkItem]:
        batch: list[WorkItem] = []
        seen: set[str] = set()
        deferred: list[WorkItem] = []
        now = self.clock()
        while self._queue and len(batch) < self.max_batch:
            item = self._queue.popleft()
            if item.abandoned:
                continue
            if item.deadline <= now:
                self._live -= 1
                item.future.set_result(EXPIRED)
                continue
            # Two different records with one id cannot share a frame (the later would be a duplicate).
            if item.record_id in seen:
                deferred.append(item)
                continue
            seen.add(item.record_id)
            item.started = True
            self._live -= 1
            batch.append(item)
        self._queue.extendleft(reversed(deferred))
        self.metrics.queue_depth.set(self._live)
        return batch

    async def _run(self) -> None:
        while True:
            if not self._queue:
                self._wakeup.clear()
                await self._wakeup.wait()
            batch = self._take()
            if not batch:
                continue
            started = self.clock()
            for item in batch:
                self.metrics.queue_wait.observe(started - item.enqueued_at)
            self._in_flight_since, self._in_flight_size = started, len(batch)
            specs = [item.spec for item in batch]
            try:
                outcome = await self._process_isolated(specs)
            finally:
                self._in_flight_since = None
            elapsed = self.clock() - started
            if not self.broken:  # a lost batch's time says nothing of what a batch costs
                self.cost.observe(len(batch), elapsed)
            self.metrics.batch_size.observe(len(batch))
            self.metrics.batch_seconds.observe(elapsed)
            for item, result in zip(batch, outcome.results, strict=True):
                if not item.future.done():
                    item.future.set_result(result)
            if self.on_batch is not None:
                try:
                    self.on_batch(batch, outcome)
                except Exception:  # bookkeeping must never stop the batcher
                    logger.exception("batch hook failed")

    async def _process_isolated(self, specs: list[ItemSpec]) -> BatchResult:
        try:
            return await self._call(specs)
        except BrokenExecutor:
            return self._lost(specs)
        except Exception:  # retried item by item below, so one bad item fails alone
            logger.exception("batch of %d failed outside the predictor; retrying items alone", len(specs))
        merged = BatchResult(results=[])
        for index, spec in enumerate(specs):
            try:
                single = await self._call([spec])
            except BrokenExecutor:
                merged.results.extend(self._lost(specs[index:]).results)
                break
            except Exception as error:  # noqa: BLE001 - reported on this item only
                merged.results.append(
                    _internal_error(self.results, spec, f"{type(error).__name__}: {error}", self.model_version)
                )
                continue
            merged.results.extend(single.results)
            merged.rows.extend(single.rows)
            merged.rejected.extend(single.rejected)
            merged.degraded = merged.degraded or single.degraded
            merged.cpu_seconds += single.cpu_seconds
        return merged

    async def _call(self, specs: list[ItemSpec]) -> BatchResult:
        """`process(specs)` on the executor. A call still running after `stuck_after_s` can answer
        none of its items in time and holds every later batch back: its process is stuck, so it is
        stopped (and replaced as a dead one is)."""
        try:
            async with asyncio.timeout(self.stuck_after_s) as limit:
                return await run_on(self.executor, self.process, specs)
        except TimeoutError:
            if not limit.expired():
                raise  # the scoring step's own error, not ours
        logger.error("a batch of %d ran past %g s: stopping the stuck scoring process", len(specs), self.stuck_after_s)
        await asyncio.to_thread(terminate, self.executor)
        raise BrokenProcessPool(f"the scoring process was stuck for {self.stuck_after_s:g} s")

    def _lost(self, specs: list[ItemSpec]) -> BatchResult:
        """The items of a batch lost with its scoring process: a server fault (503), never their own."""
        self.broken = True
        logger.exception("the scoring process died; a new one will be started")
        died = [
            _internal_error(self.results, spec, "scoring process died", self.model_version, reason=SCORING_PROCESS_DIED)
            for spec in specs
        ]
        return BatchResult(results=died)


def _internal_error(
    results: type[ItemResult], spec: ItemSpec, detail: str, model_version: str, reason: str = "internal_error"
) -> ItemResult:
    return results.for_record(
        spec.record_id,
        status="error",
        model_version=model_version,
        path="online",
        request_id=spec.request_id,
        produced_at=utc_now(),
        error=ItemError(reason=reason, detail=detail[:500]),
    )
