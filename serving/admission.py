"""Admission control: predict how long a newcomer would wait, and refuse at once when it is too long.

The cost of one adaptive batch is modelled as `fixed + per_item * n`: on this model most of a small
batch's time is fixed (validation, features, the history query), so a per-item average measured at
batch size 1 would predict a 64-request burst as 64 times the real wait and shed below capacity.
"""

from __future__ import annotations

import asyncio
import collections
import heapq
import itertools
import math
import time
from collections.abc import Callable
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
    target. `waited_s` is what the request already waited before the service saw it, as far as
    such a wait has stood (a proxy's X-Request-Start, the event loop's lag: the socket backlog);
    the deadline counts from when it began to wait.
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


class StandingMinimum:
    """The smallest sample of the last `window_s`: how much of a wait has stood for the whole
    window, CoDel's rule. A burst that drains within the window leaves a short wait in it and
    counts for nothing; a wait that every sample of the window shows is overload. Nothing counts
    until a whole window has been watched.

    Kept as a monotonic deque (each sample enters and leaves once): samples may come once per
    request, thousands per window past capacity, where a minimum over a plain list would cost
    each of them the whole window."""

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        # (time, sample), samples increasing: the front is the minimum of the window.
        self._rising: collections.deque[tuple[float, float]] = collections.deque()
        self._first: float | None = None

    def observe(self, sample_s: float, now: float) -> float:
        """Add a sample taken at `now`; returns the standing value after it."""
        if self._first is None:
            self._first = now
        while self._rising and self._rising[-1][1] >= sample_s:
            self._rising.pop()
        self._rising.append((now, sample_s))
        return self.value(now)

    def value(self, now: float) -> float:
        if self._first is None or now - self._first < self.window_s:
            return 0.0
        while self._rising and self._rising[0][0] < now - self.window_s:
            self._rising.popleft()
        return self._rising[0][1] if self._rising else 0.0


class LoopLag:
    """How late the event loop runs a timer: the time a request that arrives now waits before
    Python reads it (the socket backlog and a busy loop, which no queue of ours sees).

    Sampled every `interval_s` (event-loop-delay shedding, as fastify's under-pressure and toobusy
    do). What counts is the *standing* lag (`StandingMinimum`): a burst that the loop works
    through within the window leaves on-time samples in it and costs nothing; a loop that stays
    late for the whole window is overload, and its lag then counts against every newcomer's target.
    """

    def __init__(self, interval_s: float = 0.005, window_s: float = 0.25) -> None:
        self.interval_s = interval_s
        self.window_s = window_s
        self._standing = StandingMinimum(window_s)
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
        self.lag_s = self._standing.observe(sample_s, now)


class ConcurrencyLimit:
    """An adaptive limit on admitted requests in flight: what holds the target past capacity.

    The wait predictor sees the queue and the batches; it cannot see the CPU that admitted work
    takes from everything else on the machine. Past capacity, each admitted request costs the
    server about five refusals' worth of CPU (bench/findings.md), the event loop runs late, and
    the accepted requests themselves miss the target while the predictor still says yes. This
    limit closes the loop on what it costs: the latency admitted requests actually had, to their
    answer from when they began to wait (a proxy's stamp in full, the loop's lag as far as it
    stood: serving/gate.py's `Wait.arrived`).

    The rule is Netflix's Gradient2 and Envoy's adaptive concurrency, with the declared target in
    place of a measured minimum RTT (the target, not the fastest answer, is what is promised).
    What it holds to the target is an estimate of the p99: each `window_s` window's *mean* latency
    times the tail's shape, the p99 of the last `shape_s` of answers, each divided by its own
    window's mean. The mean follows what is in flight within one window (Little's law: at the
    service's rate r, n in flight answer in n / r on average), where a window's own p90 moved with
    a few slow answers; the shape is learnt, because it is the service's own (1.35-1.7 here, on
    SQLite past capacity and on PostgreSQL at moderate load). A fixed share of the target for the
    mean (half) held SQLite's tail but sat under what PostgreSQL answers in at any concurrency, so
    every cut there was followed by the next, down to the floor (bench/findings.md, fourteenth
    and fifteenth sessions).

    Every window whose estimate is over `headroom` x target cuts the limit by that ratio (halving
    at most), from the peak in flight, so a single window brings it to where it binds. While it
    binds within the aim it grows toward the ratio, `growth_smoothing` of the way per window (25%
    at most: Gradient2's smoothing; a jump of sqrt(limit), the rule before, overshot into the next
    cut), and while it does not bind by a quarter, so a past overload is forgotten within a second
    or two.

    A window over the headroom but with its mean within the target is tolerated for
    `burst_interval_s` (CoDel's interval, as for the queue's age): a burst at moderate load is
    served whole. Three things end that patience: a limit that binds, a mean beyond the target
    itself (an overload already missing the promise, not a queue within reach of draining), and a
    cut within the last `overload_memory_s` (an overload that let up for a window is still the same
    overload; without this, each window within the headroom granted it the interval again). A burst
    that arrived at once is admitted whole before any window closes, up to the ceiling, `max_limit`.

    The step into overload is told from a burst by how many requests it adds: `settled` is the
    limit the last window that bound within the aim left, grown as its room allowed (the
    concurrency this service was last seen to answer within the target, kept through idle
    stretches), and admissions beyond it spend a
    `burst` allowance that refills, over `burst_refill_s`, only while fewer are in flight. A burst
    spends part of it once and drains; an overload keeps arriving and spends all of it within tens
    of milliseconds, and the limit then drops to `settled` at once, where it used to climb to the
    ceiling for a window and a burst interval before its first cut (bench/findings.md, the
    seventeenth session). Until a first overload has settled, only the ceiling stands.
    """

    def __init__(
        self,
        target_s: float,
        *,
        max_limit: int,
        min_limit: int = 16,
        window_s: float = 0.1,
        burst_interval_s: float = 0.25,
        headroom: float = 0.8,
        growth_smoothing: float = 0.3,
        overload_memory_s: float = 1.0,
        shape_s: float = 1.0,
        initial_shape: float = 2.0,
        burst: int = 64,
        burst_refill_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.target_s = target_s
        self.max_limit = float(max_limit)
        self.min_limit = float(min(min_limit, max_limit))
        self.window_s = window_s
        self.burst_interval_s = burst_interval_s
        self.headroom = headroom
        self.growth_smoothing = growth_smoothing
        self.overload_memory_s = overload_memory_s
        self.clock = clock
        self.limit = self.max_limit
        self.in_flight = 0
        self.shape = TailShape(max(1, round(shape_s / window_s)), initial_shape)
        self._window_started = clock()
        self._samples: list[float] = []
        self._peak = 0
        self._refused = False
        self._over_since: float | None = None
        self._last_cut: float | None = None
        self.settled: float | None = None
        self.burst = float(burst)
        self.burst_refill_s = burst_refill_s
        self.burst_left = self.burst
        self._burst_counted_at = self._window_started

    def acquire(self) -> bool:
        """Take a slot for a request about to be admitted; False: refuse it (the limit is full)."""
        if self.full():
            return False
        if self.settled is not None and self.in_flight >= self.settled:
            self.burst_left -= 1.0
            if self.burst_left < 0.0:
                # More kept arriving than a burst brings: an overload's onset.
                self.burst_left = 0.0
                self.limit = min(self.limit, max(self.settled, self.min_limit))
                self._last_cut = self.clock()
                if self.in_flight >= max(int(self.limit), 1):
                    self._refused = True
                    return False
        self.in_flight += 1
        self._peak = max(self._peak, self.in_flight)
        return True

    def full(self) -> bool:
        """True: a request arriving now is refused (and the window counts as binding), as by
        `acquire`, but no slot is taken when there is room."""
        now = self.clock()
        self._roll(now)
        self._refill_burst(now)
        if self.in_flight >= max(int(self.limit), 1):
            self._refused = True
            return True
        return False

    def _refill_burst(self, now: float) -> None:
        # In flight changes only at acquire and release, both of which come here first, so it was
        # what it is now for the whole stretch since the last call.
        if self.settled is None or self.in_flight < self.settled:
            self.burst_left = min(
                self.burst, self.burst_left + self.burst * (now - self._burst_counted_at) / self.burst_refill_s
            )
        self._burst_counted_at = now

    def release(self, latency_s: float | None) -> None:
        """Give the slot back; `latency_s` is the request's latency, None when it never reached
        the scorer (refused later for its body), which says nothing about load."""
        now = self.clock()
        self._roll(now)
        self._refill_burst(now)
        self.in_flight = max(self.in_flight - 1, 0)
        if latency_s is not None:
            self._samples.append(latency_s)

    def current(self) -> float:
        """The limit now, with any window that has ended accounted for."""
        self._roll(self.clock())
        return self.limit

    def _roll(self, now: float) -> None:
        if now - self._window_started < self.window_s:
            return
        # Idle windows are evidence of no overload, as windows within the target are: without
        # this, a limit cut during an overload (or an outage) stayed cut through any idle stretch,
        # and the next burst after it was shed down to the floor. Nothing calls in while a service
        # is idle (unless a proxy's publisher reads the limit), so the window that ends at the
        # next call may hold the last answers before a quiet stretch: it is judged as it stood,
        # and the quiet windows after it count as idle ones.
        if self._samples:
            mean = sum(self._samples) / len(self._samples)
            self.shape.add(self._samples, mean)
            self._adjust(now, mean)
            # Every request taken in or answered closes an ended window first, so none came since.
            quiet_since = self._window_started + self.window_s
        else:
            quiet_since = self._window_started
        if self.in_flight == 0:
            self._forget_overload(int((now - quiet_since) / self.window_s))
        self._window_started = now
        self._samples = []
        self._peak = self.in_flight
        self._refused = False

    def _forget_overload(self, idle_windows: int) -> None:
        if idle_windows <= 0:
            return
        self.limit = min(self.max_limit, self.limit * 1.25 ** min(idle_windows, 64))
        self._over_since = None
        self._last_cut = None

    def _adjust(self, now: float, mean_latency_s: float) -> None:
        binding = self._refused or self._peak >= int(self.limit)
        allowed = self.headroom * self.target_s
        estimated_p99 = mean_latency_s * self.shape.ratio
        if estimated_p99 > allowed:
            if self._over_since is None:
                self._over_since = self._window_started
            recently_cut = self._last_cut is not None and now - self._last_cut < self.overload_memory_s
            beyond_target = mean_latency_s > self.target_s
            if binding or recently_cut or beyond_target or now - self._over_since >= self.burst_interval_s:
                base = min(self.limit, float(max(self._peak, 1)))
                self.limit = max(self.min_limit, base * max(0.5, allowed / estimated_p99))
                self._last_cut = now
            return
        self._over_since = None
        if not binding:
            self.limit = min(self.max_limit, self.limit * 1.25)
            return
        room = min(1.25, allowed / max(estimated_p99, 1e-9)) - 1.0
        self.limit = min(self.max_limit, self.limit * (1.0 + self.growth_smoothing * room))
        # Where an onset's cut lands: this window's limit, grown as its room allows. Recorded before
        # the growth, every growth was undone by the next admission past it once the allowance was
        # spent, and the allowance refills only below `settled`: under a load that stayed above an
        # old overload's concurrency the limit stayed there, refusing answers well within the target.
        self.settled = self.limit


class TailShape:
    """How far the p99 of answers lies above their window's mean: the 99th percentile of every
    answer's latency divided by its own window's mean, over the last `windows` windows.

    Dividing by each window's own mean keeps a change of level (an overload's onset, a cut) out of
    the shape, so the estimate of a window's p99 (its mean times the ratio) follows the level at
    once and the tail's shape over a second. Until `min_samples` answers are held, `initial` is it.
    """

    def __init__(self, windows: int, initial: float, *, quantile: float = 0.99, min_samples: int = 100) -> None:
        self.initial = initial
        self.quantile = quantile
        self.min_samples = min_samples
        self._windows: collections.deque[list[float]] = collections.deque(maxlen=windows)
        self.ratio = initial

    def add(self, samples: list[float], mean: float) -> None:
        if mean <= 0:
            return
        self._windows.append([sample / mean for sample in samples])
        count = sum(len(window) for window in self._windows)
        if count < self.min_samples:
            self.ratio = self.initial
            return
        # The k-th largest of the pooled ratios: heapq keeps k of them, not a sort of all.
        k = max(1, math.ceil((1.0 - self.quantile) * count))
        self.ratio = max(1.0, heapq.nlargest(k, itertools.chain.from_iterable(self._windows))[-1])
