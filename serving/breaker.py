"""A circuit breaker in front of the database, so a dead database costs no latency.

After `failure_threshold` consecutive failures it opens: callers skip the database for `reset_s`.
Then one probe: by a `probe` function on a thread of its own when one is given, so that no request
waits out a silent database's connect timeout, else by the next caller. Success closes it, failure
opens it again. Thread-safe; one per process.
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
    def __init__(
        self,
        failure_threshold: int,
        reset_s: float,
        clock: Callable[[], float] = time.monotonic,
        probe: Callable[[], object] | None = None,
    ) -> None:
        self.failure_threshold = failure_threshold
        self.reset_s = reset_s
        self._clock = clock
        self._probe = probe
        self._lock = threading.Lock()
        self._failures = 0
        self._opened_at: float | None = None
        # When the half-open probe was handed out; None: no probe out.
        self._probe_since: float | None = None

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
        """Whether this caller may try the database now (claims the probe when half-open and no
        `probe` function was given)."""
        with self._lock:
            state = self._state_locked()
            if state is BreakerState.CLOSED:
                return True
            now = self._clock()
            # A probe unanswered for reset_s is given up: its caller recorded neither outcome, and
            # held for good it would keep the breaker refusing everyone. A probe thread always answers.
            stale = self._probe is None and self._probe_since is not None and now - self._probe_since >= self.reset_s
            if state is not BreakerState.HALF_OPEN or (self._probe_since is not None and not stale):
                return False
            self._probe_since = now
            if self._probe is None:
                return True
        threading.Thread(target=self._run_probe, name="tandem-breaker-probe", daemon=True).start()
        return False

    def _run_probe(self) -> None:
        assert self._probe is not None
        try:
            self._probe()
        except Exception:  # noqa: BLE001 - whatever failed, the database is not back: open for reset_s
            self.record_failure()
        else:
            self.record_success()

    def record_success(self) -> None:
        with self._lock:
            self._failures = 0
            self._opened_at = None
            self._probe_since = None

    def record_failure(self) -> None:
        with self._lock:
            self._failures += 1
            self._probe_since = None
            if self._opened_at is not None or self._failures >= self.failure_threshold:
                self._opened_at = self._clock()
