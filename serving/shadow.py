"""Shadow scoring: the challenger scores a sample of what the champion answered, off the critical
path; its answers go to `challenger_predictions` (path=shadow), never to a client.

The champion's answers and p99 stay untouched: an item is offered after its batch was answered, as
a bounded append; the challenger runs in its own process at niceness 19; a shadow batch starts only
while the champion is idle, and samples are dropped (and counted) while it is over capacity.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
import zlib
from collections.abc import Callable, Sequence
from concurrent.futures import BrokenExecutor
from dataclasses import dataclass

from sqlalchemy.engine import Engine

from inference.spec import LoadedSpec
from inference.store import ResultPath, prediction_frame, upsert_challenger_predictions
from serving.backends import ScoringBackend
from serving.background import BackgroundTask
from serving.metrics import ServingMetrics
from serving.scoring import BatchResult, ItemSpec
from serving.settings import ServingSettings

logger = logging.getLogger(__name__)

_SAMPLE_SCALE = 1_000_000
# How often a waiting shadow batch looks again whether the champion is idle.
_IDLE_POLL_S = 0.005


def sampled(record_id: str, share: float) -> bool:
    """Whether the challenger shadows this record: by a hash of its id, so a retry of the
    same record is sampled alike and the sample is the same on every worker."""
    return zlib.crc32(record_id.encode()) % _SAMPLE_SCALE < share * _SAMPLE_SCALE


@dataclass(frozen=True)
class ShadowLimits:
    """Bounds of the shadow queue: fixed, since they only trade the challenger's cost against its
    sample, never the champion's latency."""

    queue_capacity: int = 512  # sampled items waiting for the challenger
    max_batch: int = 32
    linger_s: float = 0.1  # how long samples gather into one batch: each batch has a fixed cost
    max_age_s: float = 2.0  # how long a sample may wait for the champion to be idle before it is dropped


# Scheduling niceness of the challenger's scoring process: on shared cores it gets what the champion leaves.
SHADOW_NICE = 19


@dataclass(frozen=True)
class _Offered:
    spec: ItemSpec
    at: float


class ShadowScorer:
    """The challenger's side in one server process: the sample, a bounded queue, one loop that
    scores it while the champion is idle (`champion_busy`), and the writes of the shadow answers.
    """

    def __init__(
        self,
        *,
        spec: LoadedSpec,
        engine: Engine,
        settings: ServingSettings,
        metrics: ServingMetrics,
        champion_queued: Callable[[], int],
        champion_busy: Callable[[], bool],
        clock: Callable[[], float] = time.monotonic,
        limits: ShadowLimits = ShadowLimits(),
    ) -> None:
        """`spec`: the records the champion scores, which the challenger's warm-up scores too."""
        self.spec = spec
        self.engine = engine
        self.settings = settings
        self.limits = limits
        self.metrics = metrics
        self.champion_queued = champion_queued
        self.champion_busy = champion_busy
        self.clock = clock
        self.backend: ScoringBackend | None = None
        self._queue: collections.deque[_Offered] = collections.deque()
        self._wakeup = asyncio.Event()
        self._task = BackgroundTask("tandem-shadow")
        self._writes: set[asyncio.Future[None]] = set()

    @property
    def model_version(self) -> str | None:
        return None if self.backend is None else self.backend.model_version

    def set_backend(self, backend: ScoringBackend | None) -> ScoringBackend | None:
        """Shadow with `backend` from the next shadow batch on (None: stop); returns the one it
        replaced, which no new shadow batch reaches. What was queued for the old one is dropped."""
        previous, self.backend = self.backend, backend
        if previous is not None and self._queue:
            self._drop(len(self._queue), "replaced")
            self._queue.clear()
        self.metrics.shadowing_model(self.model_version)
        return previous

    # ------------------------------------------------------------------ on the event loop, per batch
    def offer(self, specs: Sequence[ItemSpec], outcome: BatchResult) -> None:
        """One champion batch, after it was answered: its sampled scored items join the shadow queue
        unless the champion is over capacity or the queue is full. A degraded batch is not offered."""
        if self.backend is None or self.settings.shadow_sample <= 0 or outcome.degraded:
            return
        share = self.settings.shadow_sample
        chosen = [
            spec
            for spec, result in zip(specs, outcome.results, strict=True)
            if result.status == "scored" and sampled(spec.record_id, share)
        ]
        if not chosen:
            return
        if self.champion_queued() >= self.settings.max_batch_size:
            # More waiting than the champion's next batch can take: it is over capacity.
            self._drop(len(chosen), "overload")
            return
        room = self.limits.queue_capacity - len(self._queue)
        now = self.clock()
        self._queue.extend(_Offered(spec, now) for spec in chosen[: max(room, 0)])
        if len(chosen) > room:
            self._drop(len(chosen) - max(room, 0), "queue_full")
        self.metrics.shadow_queue_depth.set(len(self._queue))
        self._wakeup.set()

    def _drop(self, count: int, reason: str) -> None:
        self.metrics.shadow_items["dropped"].inc(count)
        self.metrics.shadow_dropped[reason].inc(count)

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        self._task.start(self._run)

    async def close(self) -> None:
        """Stop shadowing: what is queued is dropped, what is being written is waited for."""
        await self._task.stop()
        if self._queue:
            self._drop(len(self._queue), "stale")
            self._queue.clear()
        if self._writes:
            await asyncio.gather(*self._writes, return_exceptions=True)

    async def _run(self) -> None:
        while True:
            await self._wakeup.wait()
            self._wakeup.clear()
            while self._queue:
                await self._score_next()

    async def _score_next(self) -> None:
        # Gather a batch, then wait for the champion to be idle; items age out meanwhile.
        while self._queue and (self._lingering() or self.champion_busy()):
            self._expire()
            await asyncio.sleep(_IDLE_POLL_S)
        self._expire()
        backend = self.backend
        if backend is None:  # let go of meanwhile: nothing left to score what is queued
            self._drop(len(self._queue), "replaced")
            self._queue.clear()
            return
        if not self._queue:
            return
        batch = [self._queue.popleft() for _ in range(min(len(self._queue), self.limits.max_batch))]
        self.metrics.shadow_queue_depth.set(len(self._queue))
        specs = [offered.spec for offered in batch]
        loop = asyncio.get_running_loop()
        try:
            outcome = await asyncio.wrap_future(backend.executor.submit(backend.process, specs), loop=loop)
        except Exception as error:  # whatever it was, the champion never notices
            logger.warning("shadow batch of %d failed on %s", len(batch), backend.model_version, exc_info=True)
            self._drop(len(batch), "scoring_failed")
            if isinstance(error, BrokenExecutor) and self.backend is backend:
                # Its process died: let go of it, and the challenger watcher starts another.
                self.set_backend(None)
                backend.executor.shutdown(wait=False, cancel_futures=True)
            return
        finished = self.clock()
        offered_at = {offered.spec.record_id: offered.at for offered in batch}
        rows = []
        for row in outcome.rows:
            latency_s = finished - offered_at.get(row["record_id"], finished)
            rows.append({**row, "path": ResultPath.SHADOW.value, "latency_ms": latency_s * 1000})
            self.metrics.shadow_latency.observe(latency_s)
        scored = sum(1 for result in outcome.results if result.status == "scored")
        if len(batch) > scored:  # the challenger refused an item the champion scored
            self._drop(len(batch) - scored, "scoring_failed")
        if scored > len(rows):  # replays: this input and history were shadowed, and stored, before
            self.metrics.shadow_items["scored"].inc(scored - len(rows))
        if rows:
            write = loop.run_in_executor(None, self._write, rows)
            self._writes.add(write)
            write.add_done_callback(self._writes.discard)

    def _lingering(self) -> bool:
        """The batch is not full and its oldest item has not waited `linger_s` yet."""
        if len(self._queue) >= self.limits.max_batch:
            return False
        return self.clock() - self._queue[0].at < self.limits.linger_s

    def _expire(self) -> None:
        oldest_allowed = self.clock() - self.limits.max_age_s
        expired = 0
        while self._queue and self._queue[0].at < oldest_allowed:
            self._queue.popleft()
            expired += 1
        if expired:
            self._drop(expired, "stale")
            self.metrics.shadow_queue_depth.set(len(self._queue))

    def _write(self, rows: list[dict[str, object]]) -> None:
        """Off the event loop, best effort: the outbox is for the answers clients received."""
        try:
            with self.engine.begin() as conn:
                upsert_challenger_predictions(conn, prediction_frame(rows))
        except Exception:
            logger.warning("could not store %d shadow answers", len(rows), exc_info=True)
            self._drop(len(rows), "store_error")
            return
        self.metrics.shadow_items["scored"].inc(len(rows))
