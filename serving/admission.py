"""Admission control: predict how long a newcomer would wait, and refuse at once when it is too long.

The cost of one adaptive batch is modelled as `fixed + per_item * n`: on this model most of a small
batch's time is fixed (validation, features, the history query), so a per-item average measured at
batch size 1 would predict a 64-request burst as 64 times the real wait and shed below capacity.
"""

from __future__ import annotations

import asyncio
import collections
import math
import time
from dataclasses import dataclass

from serving.background import BackgroundTask


class BatchCostModel:
    """Exponentially weighted least squares of batch duration on batch size.

    The warm-up calibration is kept as a prior that never decays, so a long run of equal-sized
    batches (all of size 1 at low load) cannot make the slope unidentifiable.
    """

    def __init__(self, decay: float, prior_weight: float = 2.0) -> None:
        self.decay = decay
        self.prior_weight = prior_weight
        self._prior = [0.0] * 5  # weight, sum n, sum n^2, sum d, sum n*d
        self._live = [0.0] * 5
        self.fixed_s = 0.0
        self.per_item_s = 0.0

    @staticmethod
    def _add(stats: list[float], n: float, seconds: float, weight: float) -> None:
        stats[0] += weight
        stats[1] += weight * n
        stats[2] += weight * n * n
        stats[3] += weight * seconds
        stats[4] += weight * n * seconds

    def calibrate(self, samples: list[tuple[int, float]]) -> None:
        """Seed from warm-up runs: (batch size, seconds)."""
        share = self.prior_weight / max(len(samples), 1)
        for n, seconds in samples:
            self._add(self._prior, n, seconds, share)
        self._fit()

    def observe(self, n: int, seconds: float) -> None:
        self._live = [value * self.decay for value in self._live]
        self._add(self._live, n, seconds, 1.0)
        self._fit()

    def _fit(self) -> None:
        w, sn, snn, sd, snd = (p + q for p, q in zip(self._prior, self._live, strict=True))
        if w <= 0:
            return
        mean_n, mean_d = sn / w, sd / w
        variance = snn / w - mean_n * mean_n
        if variance > 1e-9:
            slope = (snd / w - mean_n * mean_d) / variance
            self.per_item_s = max(slope, 0.0)
        self.fixed_s = max(mean_d - self.per_item_s * mean_n, 0.0)

    def batch_seconds(self, n: int) -> float:
        return self.fixed_s + self.per_item_s * n


@dataclass(frozen=True)
class Decision:
    admitted: bool
    predicted_wait_s: float
    limit_s: float
    reason: str | None = None  # queue_full | over_target | over_deadline

    @property
    def retry_after_s(self) -> int:
        """Whole seconds (the header's unit), at least 1, so clients back off for one drain."""
        return max(1, math.ceil(self.predicted_wait_s))


def predicted_wait(queued: int, in_flight_remaining_s: float, max_batch: int, cost: BatchCostModel) -> float:
    """Seconds until a newcomer's batch starts: the running batch, then the full batches ahead of it."""
    full_batches_ahead = queued // max_batch
    return in_flight_remaining_s + full_batches_ahead * cost.batch_seconds(max_batch)


def admit(
    *,
    items: int,
    queued: int,
    capacity: int,
    in_flight_remaining_s: float,
    max_batch: int,
    cost: BatchCostModel,
    target_s: float,
    remaining_deadline_s: float,
    oldest_queued_s: float = 0.0,
    waited_s: float = 0.0,
) -> Decision:
    """Admit when the newcomer's whole wait fits the target and its wait ahead fits its deadline.

    The wait ahead is the larger of the model's prediction and the measured age of the oldest
    queued item (its sojourn time, as in CoDel): when the machine slows down faster than the cost
    model follows, the queue's real age still stops admission before accepted work misses the
    target. `waited_s` is what the request already waited before the service saw it (a proxy's
    X-Request-Start, or the event loop's lag: the socket backlog); the deadline counts from then.
    """
    ahead = max(predicted_wait(queued, in_flight_remaining_s, max_batch, cost), oldest_queued_s)
    wait = waited_s + ahead
    limit = min(target_s, remaining_deadline_s + waited_s)
    if queued + items > capacity:
        return Decision(False, wait, limit, "queue_full")
    if ahead > remaining_deadline_s:
        return Decision(False, wait, limit, "over_deadline")
    if wait > target_s:
        return Decision(False, wait, limit, "over_target")
    return Decision(True, wait, limit)


class LoopLag:
    """How late the event loop runs a timer: the time a request that arrives now waits before
    Python reads it (the socket backlog and a busy loop, which no queue of ours sees).

    Sampled every `interval_s` (event-loop-delay shedding, as fastify's under-pressure and toobusy
    do). What counts is the *standing* lag, CoDel's rule: the smallest sample of the last
    `window_s`. A burst that the loop works through within the window leaves on-time samples in
    it and costs nothing; a loop that stays late for the whole window is overload, and its lag
    then counts against every newcomer's target.
    """

    def __init__(self, interval_s: float = 0.005, window_s: float = 0.25) -> None:
        self.interval_s = interval_s
        self.window_s = window_s
        self._samples: collections.deque[tuple[float, float]] = collections.deque()
        self._first: float | None = None
        self.lag_s = 0.0
        self._task = BackgroundTask("tandem-loop-lag")

    def start(self) -> None:
        self._task.start(self._run)

    async def stop(self) -> None:
        await self._task.stop()

    async def _run(self) -> None:
        while True:
            expected = time.monotonic() + self.interval_s
            await asyncio.sleep(self.interval_s)
            now = time.monotonic()
            self.observe(max(now - expected, 0.0), now)

    def observe(self, sample_s: float, now: float) -> None:
        if self._first is None:
            self._first = now
        self._samples.append((now, sample_s))
        while self._samples[0][0] < now - self.window_s:
            self._samples.popleft()
        # Until a whole window has been watched, nothing has stood for one.
        stood = now - self._first >= self.window_s
        self.lag_s = min(sample for _, sample in self._samples) if stood else 0.0
