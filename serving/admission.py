"""Admission control: predict how long a newcomer would wait, and refuse at once when it is too long.

A batch costs `fixed + per_item * n`: most of a small batch's time is fixed, so a per-item average
would predict a burst's wait many times too long and shed below capacity.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass


class BatchCostModel:
    """Exponentially weighted least squares of batch duration on batch size. The warm-up is a prior
    that never decays, so a long run of equal-sized batches cannot make the slope unidentifiable.
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
    reason: str | None = None  # queue_full | over_target | over_deadline | concurrency_limit

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
) -> Decision:
    """The one admission rule: a bounded queue that admits a newcomer only when its expected wait
    fits the p99 target and, with its own batch, its remaining deadline; a refusal now beats an
    answer too late."""
    wait = predicted_wait(queued, in_flight_remaining_s, max_batch, cost)
    limit = min(target_s, remaining_deadline_s)
    if queued + items > capacity:
        return Decision(False, wait, limit, "queue_full")
    # A deadline shorter than the newcomer's own batch could only end in a 504 after the work.
    own_batch = cost.batch_seconds(min(queued % max_batch + items, max_batch))
    if wait + own_batch > remaining_deadline_s:
        return Decision(False, wait, limit, "over_deadline")
    if wait > target_s:
        return Decision(False, wait, limit, "over_target")
    return Decision(True, wait, limit)


class AimdLimit:
    """AIMD on admitted requests in flight, the one adaptive limit beside the queue: the queue cannot
    see a request's time in a saturated event loop before and after its batch; its latency can.

    An answer over the target cuts the limit by `BACKOFF`, at most once per `target_s` (the time a
    cut takes to show). An answer within it, while the limit is at least half used, adds one request
    per limit's worth of answers. Once no answer has been over the target for `CALM_S`, the overload
    that cut the limit is over: each answer within it adds one, back to the ceiling a burst is
    admitted under (used or not: at normal load the limit is never half used).
    """

    MIN_LIMIT = 8  # about capacity x latency at the target: below it goodput starves
    BACKOFF = 0.9
    # Longer than a limit's dips during an overload: regrowing at once in them lost half the goodput.
    CALM_S = 5.0

    def __init__(self, target_s: float, max_limit: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.target_s = target_s
        self.max_limit = max_limit
        self.limit = float(max_limit)
        self.in_flight = 0
        self.clock = clock
        self._last_cut = -math.inf
        self._last_over = -math.inf

    def acquire(self) -> bool:
        if self.in_flight >= int(self.limit):
            return False
        self.in_flight += 1
        return True

    def release(self, latency_s: float | None) -> None:
        """An admitted request ended: answered after `latency_s`, or refused for its body (None)."""
        in_flight, self.in_flight = self.in_flight, self.in_flight - 1
        if latency_s is None:
            return
        now = self.clock()
        if latency_s > self.target_s:
            self._last_over = now
            if now - self._last_cut >= self.target_s:
                self.limit = max(float(self.MIN_LIMIT), self.limit * self.BACKOFF)
                self._last_cut = now
        elif now - self._last_over >= self.CALM_S:
            self.limit = min(float(self.max_limit), self.limit + 1.0)
        elif 2 * in_flight >= self.limit:
            self.limit = min(float(self.max_limit), self.limit + 1 / self.limit)
