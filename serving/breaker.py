"""A circuit breaker in front of the database, so a dead database costs no latency.

Closed: calls go through. After `failure_threshold` consecutive failures it opens: callers skip the
database at once for `reset_s`. Then it is half-open: exactly one caller probes; success closes it,
failure opens it again. Thread-safe. One per process, not one in all: the server process's breaker
is shared by the result writer and the idempotency store (serving/runtime.py), and each scoring
process has its own for history reads and stored-answer lookups (serving/worker.py); the two learn
of an outage separately, and the metric shows the worse of them.
"""

from __future__ import annotations

import enum
import threading
import time
from collections.abc import Callable


class BreakerState(enum.IntEnum):
    CLOSED = 0
    HALF_OPEN = 1
    OPEN = 2


class CircuitBreaker:
    def __init__(self, failure_threshold: int, reset_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.failure_threshold = failure_threshold
        self.reset_s = reset_s
        self._clock = clock
        self._lock = threading.Lock()
        self._failures = 0
        self._opened_at: float | None = None
        self._probing = False

    @property
    def state(self) -> BreakerState:
        with self._lock:
            return self._state_locked()

    def _state_locked(self) -> BreakerState:
        if self._opened_at is None:
            return BreakerState.CLOSED
        if self._clock() - self._opened_at >= self.reset_s:
            return BreakerState.HALF_OPEN
        return BreakerState.OPEN

    def allow(self) -> bool:
        """Whether this caller may try the database now (claims the probe when half-open)."""
        with self._lock:
            state = self._state_locked()
            if state is BreakerState.CLOSED:
                return True
            if state is BreakerState.HALF_OPEN and not self._probing:
                self._probing = True
                return True
            return False

    def give_back_probe(self) -> None:
        """The caller `allow` let through failed for a reason that says nothing about the database
        (a local error, a bug): the next caller probes. A probe claimed and never answered kept the
        breaker half-open and refusing every caller for good."""
        with self._lock:
            self._probing = False

    def record_success(self) -> None:
        with self._lock:
            self._failures = 0
            self._opened_at = None
            self._probing = False

    def record_failure(self) -> None:
        with self._lock:
            self._failures += 1
            self._probing = False
            if self._opened_at is not None or self._failures >= self.failure_threshold:
                self._opened_at = self._clock()
